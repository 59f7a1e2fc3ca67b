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


def test_generate_exit_codes():
    assert CliRunner().invoke(main, ["generate", ""]).exit_code == 2  # empty prompt: invalid input
    r = CliRunner().invoke(main, ["generate", "hi", "--model", "no-such-model"])
    assert r.exit_code == 3 and "unknown model" in r.stderr
    assert CliRunner().invoke(main, ["generate", "hi", "--capacity", "lots"]).exit_code == 2
    assert CliRunner().invoke(main, ["generate", "hi", "--max-new-tokens", "0"]).exit_code == 2
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "Exit codes" in r.output
