"""The `racer-batch generate` command on the real default model, and its exit codes."""

import json

import pytest
from click.testing import CliRunner

from racer_batch.cli import main

pytestmark = pytest.mark.integration


def test_generate_json_and_text():
    r = CliRunner().invoke(main, ["generate", "Name three colours.", "--max-new-tokens", "12", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["output_tokens"] <= 12 and out["text"]
    assert out["finish_reason"] in ("eos", "length") and out["method"] == "racer"
    assert out["stats"]["steps"] >= 1 and out["stats"]["mat"] >= 1.0
    r = CliRunner().invoke(main, ["generate", "Name three colours.", "--max-new-tokens", "8", "--method", "ar"])
    assert r.exit_code == 0 and "MAT=1.00" in r.stderr
    assert "Loading weights" not in r.stderr  # transformers' per-tensor bar stays off on the command line


def test_generate_exit_codes():
    assert CliRunner().invoke(main, ["generate", ""]).exit_code == 2  # empty prompt: invalid input
    r = CliRunner().invoke(main, ["generate", "hi", "--model", "no-such-model"])
    assert r.exit_code == 3 and "unknown model" in r.stderr
    assert r.stderr.startswith("Error: ")  # one style for every command's errors (CliExit)
    assert CliRunner().invoke(main, ["generate", "hi", "--capacity", "lots"]).exit_code == 2
    assert CliRunner().invoke(main, ["generate", "hi", "--max-new-tokens", "0"]).exit_code == 2
    # weights that no machine could run with the other options: a usage error, before any model loads
    r = CliRunner().invoke(main, ["generate", "hi", "--weights", "as_stored", "--dtype", "bfloat16"])
    assert r.exit_code == 2 and "as_stored' runs in float32" in r.stderr
    r = CliRunner().invoke(main, ["generate", "hi", "--weights", "as_stored", "--model", "tiny-random"])
    assert r.exit_code == 2 and "no stored blocks" in r.stderr
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "Exit codes" in r.output


def test_generate_gives_a_job_rows_answer(tmp_path):
    """Issue 13, part 5: the same messages give the same answer in `generate` and in a job (the demo's
    preset), because neither injects a system prompt: both use the model's own chat template."""
    from racer_batch.service.execution.runner import RowRunner
    from racer_batch.service.job.rows import parse_row
    from racer_batch.service.job.spec import load_spec

    prompt = "Name three colours."
    r = CliRunner().invoke(main, ["generate", prompt, "--model", "tiny-random", "--max-new-tokens", "12", "--json"])
    assert r.exit_code == 0, r.output
    alone = json.loads(r.stdout.strip().splitlines()[-1])
    spec = load_spec(None, {"input.path": str(tmp_path / "in.jsonl"), "output.path": str(tmp_path / "out"),
                            "model.name": "tiny-random", "preset": "racer-cpu", "generation.max_new_tokens": 12})
    row = parse_row(spec, 0, {"id": "a", "prompt": prompt})
    rec, _ = RowRunner(worker_name="t").answer_row(spec, row, {"id": "a", "row_idx": 0}, job_id="t")
    assert rec.status == "ok", rec.error
    assert (rec.prompt_tokens, rec.text) == (alone["prompt_tokens"], alone["text"])
    # an explicit system prompt is still honoured, and it is not what the default does
    r = CliRunner().invoke(main, ["generate", prompt, "--model", "tiny-random", "--max-new-tokens", "2", "--json",
                                  "--system", "You are a helpful assistant."])
    assert json.loads(r.stdout.strip().splitlines()[-1])["prompt_tokens"] != alone["prompt_tokens"]
