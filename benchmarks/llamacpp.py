"""llama.cpp as a benchmark contender, run out of process in its own venv (benchmarks/llamacpp_venv.sh).

Two halves share this file:

* the client (``LlamaCppWorker``, ``ensure_venv``), imported from our venv; it never imports ``llama_cpp``;
* the worker, run by the llama venv's python::

      .venv-llamacpp/bin/python benchmarks/llamacpp.py worker --model M.gguf --threads 2 --ctx 4096

Protocol (one JSON object a line). The worker first writes a handshake
``{"ready": true, "version", "system_info", "model", "threads", "ctx", "eog": [end-of-generation ids]}``, then answers
each request ``{"ids": [...], "max_new": 256, "lookup": false}`` (optional ``"eos": [...]``: the ids that end
generation, default llama.cpp's end-of-generation set) with
``{"ids": [...], "ms": ..., "prompt_ms": ..., "stop": the end token met or null}``, or ``{"error": "..."}`` for a
request it cannot run.

Generation is greedy (temperature 0: a penalties stage at its no-op settings, then argmax; no other sampler),
the prompt is taken as token ids, and the KV cache is cleared before every request, so each one pays its own
prefill. It stops when the model emits an end-of-generation token, which is NOT included in ``ids``, after
``max_new`` tokens, or when the context is full. ``ms`` is the wall time of the whole generation (prefill
included); ``prompt_ms`` the time to the first generated token (prefill plus its sampling). ``lookup`` runs
llama-cpp-python's prompt-lookup speculative decoding (``LlamaPromptLookupDecoding(num_pred_tokens=10)``) on a
second ``Llama`` object, loaded on the first such request (the weights are mmapped, so both share them).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_SCRIPT = Path(__file__).resolve().with_name("llamacpp_venv.sh")
DEFAULT_VENV = ".venv-llamacpp"
STDERR_TAIL_LINES = 40


# ----------------------------------------------------------------------------------------------- client side


def _script_version() -> str:
    """The llama-cpp-python version the venv script pins (its ``VERSION=`` line)."""
    m = re.search(r'^VERSION="([^"]+)"', VENV_SCRIPT.read_text(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{VENV_SCRIPT} has no VERSION=\"...\" line")
    return m.group(1)


def ensure_venv(path: str | os.PathLike = DEFAULT_VENV) -> str:
    """Path of the llama venv's python, building the venv first (``llamacpp_venv.sh``) unless it is done.

    A relative ``path`` is taken from the repository root. The build takes minutes; its log goes to our stderr.

    Raises:
        RuntimeError: the build script failed.
    """
    venv = Path(path)
    if not venv.is_absolute():
        venv = REPO_ROOT / venv
    python = venv / "bin" / "python"
    if python.is_file() and (venv / f".built-{_script_version()}").is_file():
        return str(python)
    done = subprocess.run(["bash", str(VENV_SCRIPT), str(venv)], stdout=sys.stderr, stderr=sys.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{VENV_SCRIPT} {venv} failed with exit status {done.returncode}")
    return str(python)


class LlamaCppWorker:
    """A llama.cpp worker subprocess holding one GGUF model; a context manager (``close`` on exit).

    Args:
        python: the llama venv's python (``ensure_venv()``).
        model: path of the ``.gguf`` file.
        threads: threads for prefill and decode.
        ctx: context length (prompt plus generated tokens).

    Raises:
        RuntimeError: the worker died or failed to load the model (the message holds its stderr tail).
    """

    def __init__(self, python: str, model: str, threads: int = 2, ctx: int = 4096) -> None:
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        cmd = [python, str(Path(__file__).resolve()), "worker", "--model", str(model), "--threads", str(threads),
               "--ctx", str(ctx)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, bufsize=1)
        self._drain = threading.Thread(target=self._read_stderr, name="llamacpp-stderr", daemon=True)
        self._drain.start()
        hello = self._read()
        if not hello.get("ready"):
            self.close()
            raise RuntimeError(f"llama.cpp worker sent no handshake: {hello!r}")
        self._hello = hello

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._stderr_tail.append(line.rstrip("\n"))

    def _died(self, what: str) -> RuntimeError:
        """The error for a worker that stopped answering, with its exit status and stderr tail."""
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self._drain.join(timeout=2)
        tail = "\n".join(self._stderr_tail) or "(nothing)"
        return RuntimeError(f"llama.cpp worker {what} (exit status {code}); its stderr ends with:\n{tail}")

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise self._died("died")
        try:
            return json.loads(line)
        except json.JSONDecodeError as exc:
            raise RuntimeError(f"llama.cpp worker wrote a line that is not JSON: {line[:200]!r}") from exc

    @property
    def eog(self) -> list[int]:
        """The ids that end generation by default (llama.cpp's end-of-generation tokens of the model)."""
        return list(self._hello["eog"])

    def version(self) -> tuple[str, str]:
        """``(llama_cpp.__version__, llama_cpp.llama_print_system_info())`` of the worker's build."""
        return self._hello["version"], self._hello["system_info"]

    def generate(self, ids: list[int], max_new: int, lookup: bool = False) -> tuple[list[int], float]:
        """Greedy continuation of the prompt ``ids``: (generated ids without the end token, wall ms).

        Raises:
            RuntimeError: the worker died, or refused the request (the message says why).
        """
        reply = self.request(ids, max_new, lookup)
        return reply["ids"], reply["ms"]

    def request(self, ids: list[int], max_new: int, lookup: bool = False,
                eos: list[int] | None = None) -> dict[str, Any]:
        """One request; the worker's whole reply (``ids``, ``ms``, ``prompt_ms``). ``eos`` overrides the ids
        that end generation."""
        if self._proc.poll() is not None:
            raise self._died("is not running")
        msg: dict[str, Any] = {"ids": [int(t) for t in ids], "max_new": int(max_new), "lookup": bool(lookup)}
        if eos is not None:
            msg["eos"] = [int(t) for t in eos]
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise self._died("died") from None
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"llama.cpp worker refused the request: {reply['error']}")
        return reply

    def close(self) -> None:
        """Stop the worker (end of input, then terminate if it lingers)."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.terminate()
                self._proc.wait(timeout=10)
        self._drain.join(timeout=2)

    def __enter__(self) -> LlamaCppWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------- worker side


class _Generator:
    """The worker's models: a plain ``Llama`` and, loaded on first use, one with prompt-lookup drafting."""

    def __init__(self, model: str, threads: int, ctx: int) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.model, self.threads, self.ctx = model, threads, ctx
        self.plain = self._load(draft=None)
        self._lookup: Any = None
        vocab = llama_cpp.llama_model_get_vocab(self.plain.model)
        self.eog = frozenset(t for t in range(self.plain.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))

    def _load(self, draft: Any) -> Any:
        return self._llama_cpp.Llama(
            model_path=self.model, n_threads=self.threads, n_threads_batch=self.threads, n_ctx=self.ctx,
            n_batch=512, verbose=False, logits_all=draft is not None, draft_model=draft,
        )

    def lookup(self) -> Any:
        """The prompt-lookup ``Llama``. It must keep logits for every position (``logits_all``): without it
        llama-cpp-python sizes its logits buffer to one batch (512 rows) and a draft verified past position ~500
        fails ("could not broadcast ... into shape (8 * n_vocab,)")."""
        if self._lookup is None:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self._lookup = self._load(draft=LlamaPromptLookupDecoding(num_pred_tokens=10))
        return self._lookup

    def run(self, ids: list[int], max_new: int, lookup: bool, eos: frozenset[int]) -> dict[str, Any]:
        """Answer one request (see the module docstring)."""
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.ctx:
            raise ValueError(f"prompt has {len(ids)} tokens but the context is {self.ctx}")
        llm = self.lookup() if lookup else self.plain
        llm.reset()  # n_tokens = 0: generate() finds no prefix to reuse and clears the whole KV cache
        room = min(max_new, self.ctx - len(ids))
        out: list[int] = []
        prompt_ms, stop = None, None
        t0 = time.perf_counter()
        if room > 0:
            stream = llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0, repeat_penalty=1.0,
                                  frequency_penalty=0.0, presence_penalty=0.0, reset=True)
            for tok in stream:
                if prompt_ms is None:
                    prompt_ms = (time.perf_counter() - t0) * 1000.0
                if tok in eos:
                    stop = int(tok)
                    break
                out.append(int(tok))
                if len(out) >= room:
                    break
            stream.close()
        ms = (time.perf_counter() - t0) * 1000.0
        return {"ids": out, "ms": ms, "prompt_ms": prompt_ms, "stop": stop}


def _serve(gen: _Generator, inp: TextIO, out: TextIO) -> None:
    """Answer request lines from ``inp`` until it ends."""
    for line in inp:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            eos = frozenset(int(t) for t in req["eos"]) if "eos" in req else gen.eog
            reply = gen.run([int(t) for t in req["ids"]], int(req.get("max_new", 256)), bool(req.get("lookup")), eos)
        except Exception as exc:  # noqa: BLE001 - any failure is reported on the request, the worker goes on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def worker_main(argv: list[str]) -> int:
    """Entry point of ``llamacpp.py worker``: load the model, handshake, serve stdin."""
    ap = argparse.ArgumentParser(prog="llamacpp.py worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="path of the .gguf file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args(argv)
    # Keep a private handle on the real stdout for the protocol, then point fd 1 (and sys.stdout) at stderr so
    # anything llama.cpp or Python prints cannot corrupt the JSON stream.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import llama_cpp

    gen = _Generator(args.model, args.threads, args.ctx)
    hello = {"ready": True, "version": llama_cpp.__version__,
             "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
             "model": args.model, "threads": args.threads, "ctx": args.ctx, "eog": sorted(gen.eog)}
    proto.write(json.dumps(hello) + "\n")
    proto.flush()
    _serve(gen, sys.stdin, proto)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "worker":
        sys.exit("usage: llamacpp.py worker --model PATH.gguf [--threads N] [--ctx N]")
    sys.exit(worker_main(sys.argv[2:]))
