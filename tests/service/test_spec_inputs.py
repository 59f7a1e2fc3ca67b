"""Job spec and input validation (no Redis, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from racer_batch.service.job.inputs import InputError, InvalidText, check_ids, plan_input
from racer_batch.service.job.rows import parse_row
from racer_batch.service.job.spec import SpecError, load_spec
from tests.fixtures import base_overrides, write_parquet

ROOT = Path(__file__).resolve().parents[2]


def test_demo_spec_and_presets_load():
    spec = load_spec(ROOT / "jobs" / "demo.yaml")
    assert spec.decoding.method == "racer" and spec.decoding.capacity == 16  # from the shipped preset racer-cpu
    assert spec.generation.max_new_tokens == 96  # the job file beats the preset
    assert Path(spec.input.path) == ROOT / "jobs" / "demo_prompts.jsonl"  # relative to the job file
    for preset, method, capacity in (("racer-paper", "racer", 64), ("racer-cpu", "racer", 16), ("ar", "ar", 1),
                                     ("pld", "pld", 16)):
        s = load_spec(ROOT / "jobs" / "demo.yaml", {"preset": preset})
        assert (s.decoding.method, s.decoding.capacity) == (method, capacity)
        # issue 13: no preset injects a system prompt (the model's chat template alone, as `generate`)
        assert s.generation.system_prompt is None, preset
    assert sorted(p.stem for p in (ROOT / "racer_batch" / "presets").glob("*.yaml")) == [
        "ar", "pld", "racer-cpu", "racer-paper"]


def test_a_changed_default_names_the_key_that_keeps_a_folder_from_resuming(tmp_path):
    """A folder written when presets injected a system prompt is refused with the key that differs and how
    to resume it, and resumes once that value is set again."""
    from racer_batch.service.results.output import OutputError, check_output_folder, write_manifest

    old = load_spec(ROOT / "jobs" / "demo.yaml", {"output.path": str(tmp_path / "out"),
                                                  "generation.system_prompt": "You are a helpful assistant."})
    write_manifest(old.output.path, {"job_id": "j-old", "spec": old.stored(), "spec_hash": old.spec_hash()})
    new = load_spec(ROOT / "jobs" / "demo.yaml", {"output.path": str(tmp_path / "out")})
    with pytest.raises(OutputError, match=r"generation.system_prompt = 'You are a helpful assistant.' in the "
                                          r"folder, None now.*--set KEY=VALUE"):
        check_output_folder(new.output.path, spec_hash=new.spec_hash(), spec=new.stored())
    assert check_output_folder(old.output.path, spec_hash=old.spec_hash(), spec=old.stored()) == "j-old"


def test_flags_beat_file(tmp_path):
    spec = load_spec(ROOT / "jobs" / "demo.yaml", {"decoding.capacity": 8, "generation.max_new_tokens": 5,
                                                   "output.path": "rel/out"})
    assert spec.decoding.capacity == 8 and spec.generation.max_new_tokens == 5
    assert spec.output.path == str(Path.cwd() / "rel" / "out")  # flag paths are relative to the cwd


@pytest.mark.parametrize("override, key, shown", [
    ({"decoding.capacity": 5000}, "decoding.capacity", "5000"),
    ({"decoding.bogus": 1}, "decoding.bogus", "1"),
    ({"colour": "red"}, "colour", '"red"'),
    ({"priority": 12}, "priority", "12"),
    ({"decoding.method": "medusa"}, "decoding.method", '"medusa"'),
    ({"output.shard_rows": 0}, "output.shard_rows", "0"),
])
def test_spec_errors_name_key_and_value(override, key, shown):
    with pytest.raises(SpecError) as err:
        load_spec(ROOT / "jobs" / "demo.yaml", override)
    assert f"{key} = {shown}" in str(err.value)


def test_spec_errors_read_as_our_words_not_pydantic_boilerplate(tmp_path):
    """A missing section is ``required`` (no value shown: pydantic's input there is the parent section), a
    bound reads ``must be >= 1``, an unknown key names the nearest known key of its section."""
    spec = tmp_path / "job.yaml"
    spec.write_text("input: {path: in.parquet}\ndecoding: {capcity: 4}\ngeneration: {max_new_tokens: -3}\n"
                    "resources: {gpus: 1, colour: red}\n")
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    msg = str(err.value)
    for line in ("  output: required", "  decoding.capcity = 4: unknown key (did you mean 'capacity'?)",
                 "  generation.max_new_tokens = -3: must be >= 1",
                 "  resources.gpus = 1: unknown key (did you mean 'gpus_per_actor'?)",
                 '  resources.colour = "red": unknown key'):
        assert line in msg.splitlines(), msg
    assert "Field required" not in msg and "Extra inputs" not in msg and "Input should" not in msg


def test_spec_yaml_cannot_execute(tmp_path):
    bad = tmp_path / "evil.yaml"
    bad.write_text("input: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)


def test_duplicate_ids_refused_listing_first(tmp_path):
    write_parquet(tmp_path / "in.parquet", [{"id": i % 7, "prompt": "p"} for i in range(20)])
    spec = load_spec(None, base_overrides(tmp_path))
    plan = plan_input(spec.input)
    with pytest.raises(InputError) as err:
        check_ids(spec.input, plan)
    msg = str(err.value)
    assert "7 ids appear more than once (13 extra rows)" in msg and msg.endswith("'0', '1', '2', '3', '4' and 2 more")


@pytest.mark.parametrize("rows, schema, match", [
    ([{"prompt": "x"}], None, "missing id column 'id'"),
    ([{"id": 1, "text": "x"}], None, "needs one of the columns"),
    ([{"id": 1.5, "prompt": "x"}], None, "column 'id' has type double"),
    ([{"id": 1, "prompt": 3}], None, "column 'prompt' has type int64, expected string"),
    ([{"id": 1, "prompt": "x", "max_new_tokens": "ten"}], None, "column 'max_new_tokens' has type string"),
])
def test_bad_input_schema(tmp_path, rows, schema, match):
    write_parquet(tmp_path / "in.parquet", rows, schema)
    spec = load_spec(None, base_overrides(tmp_path))
    with pytest.raises(InputError, match=match):
        plan_input(spec.input)


def test_null_id_refused(tmp_path):
    write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "x"}, {"id": None, "prompt": "y"}])
    spec = load_spec(None, base_overrides(tmp_path))
    with pytest.raises(InputError, match="row 1 .*id is null"):
        check_ids(spec.input, plan_input(spec.input))


def test_missing_input_path(tmp_path):
    spec = load_spec(None, base_overrides(tmp_path, **{"input.path": str(tmp_path / "nope.parquet")}))
    with pytest.raises(InputError, match="no such file"):
        plan_input(spec.input)


def test_parse_row_kinds(tmp_path):
    spec = load_spec(None, base_overrides(tmp_path, **{"generation.system_prompt": "Be brief."}))
    ok = parse_row(spec, 3, {"id": 7, "prompt": "hi", "temperature": 0.5, "stop": "END"})
    assert ok.error is None and ok.id == "7" and ok.seed == 3
    assert ok.chat == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ok.params.temperature == 0.5 and ok.params.stop == ["END"]
    multi = parse_row(spec, 0, {"id": "m", "turns": ["a", "b"], "route": "chat", "seed": 9})
    assert multi.turns == ["a", "b"] and multi.route == "chat" and multi.params.seed == 9
    cases = {
        "prompt is empty": {"id": 1, "prompt": "   "},
        "all null": {"id": 1, "prompt": None},
        "max_new_tokens = 0": {"id": 1, "prompt": "x", "max_new_tokens": 0},
        "top_p = 1.5": {"id": 1, "prompt": "x", "top_p": 1.5},
        "several prompt fields": {"id": 1, "prompt": "x", "turns": ["y"]},
        "turns is empty": {"id": 1, "turns": []},
        "messages[0].role = 'robot'": {"id": 1, "messages": [{"role": "robot", "content": "x"}]},
        "last message must be from the user": {"id": 1, "messages": [{"role": "assistant", "content": "x"}]},
    }
    for expected, rec in cases.items():
        assert expected in (parse_row(spec, 0, rec).error or ""), (expected, parse_row(spec, 0, rec).error)


def test_parse_row_reference(tmp_path):
    """The optional reference column: one entry per turn; an unusable value is dropped, never fails the row."""
    spec = load_spec(None, base_overrides(tmp_path))

    def ref(rec):
        row = parse_row(spec, 0, {"id": "r", **rec})
        assert row.error is None, row.error  # a reference never makes a row bad
        return row.reference

    assert ref({"prompt": "x"}) is None and ref({"prompt": "x", "reference": None}) is None
    assert ref({"prompt": "x", "reference": "18"}) == ["18"]
    assert ref({"prompt": "x", "reference": "Half of it.\n#### 1,000"}) == ["Half of it.\n#### 1,000"]
    assert ref({"prompt": "x", "reference": 18}) == ["18"] and ref({"prompt": "x", "reference": 2.0}) == ["2"]
    assert ref({"prompt": "x", "reference": ["18"]}) == ["18"]
    assert ref({"prompt": "x", "reference": "  "}) is None and ref({"prompt": "x", "reference": [""]}) is None
    two = {"turns": ["a", "b"]}
    assert ref({**two, "reference": ["#### 7", None]}) == ["#### 7", None]
    assert ref({**two, "reference": "7"}) == [None, "7"]  # a single reference is the final answer's
    assert ref({**two, "reference": ["7"]}) is None  # one per turn or nothing: guessing the turn is worse
    assert ref({"prompt": "x", "reference": {"a": 1}}) is None and ref({"prompt": "x", "reference": True}) is None
    assert ref({"prompt": "x", "reference": ["18", {"a": 1}]}) is None
    bad = InvalidText(column="reference", detail="byte 0xff at offset 0")
    assert ref({"prompt": "x", "reference": bad}) is None
    # a broken prompt still fails the row, whatever the reference
    assert parse_row(spec, 0, {"id": "r", "prompt": " ", "reference": "18"}).error == "prompt is empty"
    # a renamed column
    renamed = load_spec(None, base_overrides(tmp_path, **{"input.columns.reference": "answer"}))
    assert parse_row(renamed, 0, {"id": "r", "prompt": "x", "answer": "42", "reference": "no"}).reference == ["42"]


@pytest.mark.parametrize("value, ok", [("18", True), (18, True), (1.5, True), (["a", None], True),
                                       ({"a": 1}, False), ([{"a": 1}], False)])
def test_reference_column_type_checked_at_submit(tmp_path, value, ok):
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x", "reference": value}])
    spec = load_spec(None, base_overrides(tmp_path))
    if ok:
        assert "reference" in plan_input(spec.input).columns
    else:
        with pytest.raises(InputError, match="column 'reference' has type .*expected string, number"):
            plan_input(spec.input)


def test_jsonl_input(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    spec = load_spec(None, base_overrides(tmp_path, **{"input.path": str(tmp_path / "in.jsonl")}))
    plan = plan_input(spec.input)
    assert plan.format == "jsonl" and plan.num_rows == 2


@pytest.mark.parametrize("bad_line, why", [('{"id": "c", "prompt": "z"', "Expecting ',' delimiter (column 26)"),
                                           ('["c", "z"]', "a JSON list")])
def test_bad_jsonl_line_is_named_from_one(tmp_path, bad_line, why):
    """A broken JSONL line is named by its line number counted from 1 (blank lines counted too) and what is
    wrong with it, not by Arrow's 0-based row of its parser."""
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n\n{"id": "b", "prompt": "y"}\n' + bad_line + "\n")
    spec = load_spec(None, base_overrides(tmp_path, **{"input.path": str(tmp_path / "in.jsonl")}))
    with pytest.raises(InputError) as err:
        plan_input(spec.input)
    assert str(err.value) == f"{tmp_path / 'in.jsonl'}, line 4: not a JSON object ({why})"


def test_folder_input_streams_shards(tmp_path):
    for k in range(3):
        write_parquet(tmp_path / "in" / f"f{k}.parquet", [{"id": f"{k}-{i}", "prompt": "p"} for i in range(5)])
    spec = load_spec(None, base_overrides(tmp_path, **{"input.path": str(tmp_path / "in")}))
    plan = plan_input(spec.input)
    assert plan.num_rows == 15 and plan.num_shards(4) == 4
    from racer_batch.service.job.inputs import iter_raw_rows

    got = [(i, r["id"]) for i, r in iter_raw_rows(plan, 4, 11, ["id"])]
    assert got == [(4, "0-4"), (5, "1-0"), (6, "1-1"), (7, "1-2"), (8, "1-3"), (9, "1-4"), (10, "2-0")]


def test_pool_shape():
    from racer_batch.service.execution.actors import PoolShape, resolve_shape
    from racer_batch.service.job.spec import Resources

    assert resolve_shape(Resources(), cluster_cpus=2, cluster_gpus=0) == PoolShape(1, 2.0, 0.0)
    assert resolve_shape(Resources(num_actors=1), cluster_cpus=2, cluster_gpus=0) == PoolShape(1, 2.0, 0.0)
    assert resolve_shape(Resources(), cluster_cpus=32, cluster_gpus=4) == PoolShape(4, 8.0, 1.0)
    assert resolve_shape(Resources(gpus_per_actor=0.5), cluster_cpus=16, cluster_gpus=2) == PoolShape(4, 4.0, 0.5)
    assert resolve_shape(Resources(num_actors=3, cpus_per_actor=1), cluster_cpus=8, cluster_gpus=0) == \
        PoolShape(3, 1.0, 0.0)


def test_iter_shards_one_pass_with_skips(tmp_path):
    from racer_batch.service.job.inputs import iter_shards

    for k in range(2):
        write_parquet(tmp_path / "in" / f"f{k}.parquet", [{"id": k * 5 + i, "prompt": "p"} for i in range(5)])
    spec = load_spec(None, base_overrides(tmp_path, **{"input.path": str(tmp_path / "in")}))
    plan = plan_input(spec.input)
    got = [(s, [r["id"] for _, r in rows]) for s, rows in iter_shards(plan, columns=["id"], shard_rows=4,
                                                                       skip=frozenset({1}))]
    assert got == [(0, [0, 1, 2, 3]), (2, [8, 9])]
    assert [s for s, _ in iter_shards(plan, columns=["id"], shard_rows=3)] == [0, 1, 2, 3]


def test_model_dtype_is_hashed_only_when_set_and_reaches_load_model(tmp_path, monkeypatch):
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    plain = load_spec(None, base_overrides(tmp_path))
    assert plain.model.dtype is None
    bf16 = load_spec(None, base_overrides(tmp_path, **{"model.dtype": "bfloat16"}))
    assert bf16.model.dtype == "bfloat16" and bf16.spec_hash() != plain.spec_hash()
    with pytest.raises(SpecError, match="model.dtype"):
        load_spec(None, base_overrides(tmp_path, **{"model.dtype": "int3"}))
    seen = {}
    import racer_batch.models as models
    from racer_batch.service.execution.runner import default_loader

    monkeypatch.setattr(models, "load_model", lambda name, **kw: seen.update(kw, name=name) or "bundle")
    real = bf16.model.model_copy(update={"name": "smollm2-135m"})  # base_overrides uses the stand-in model
    assert default_loader(real, allow_remote_code=False, device="cpu") == "bundle"
    assert seen["dtype"] == "bfloat16" and seen["name"] == "smollm2-135m"


def test_model_weights_is_not_hashed_and_reaches_load_model(tmp_path, monkeypatch):
    """``model.weights`` (as_stored | float32) never changes a row, so it leaves the spec hash alone (a job
    resumed under the other setting keeps its shards); the loader gets it; anything else is refused."""
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "x"}])
    plain = load_spec(None, base_overrides(tmp_path))
    assert plain.model.weights is None
    f32 = load_spec(None, base_overrides(tmp_path, **{"model.weights": "float32"}))
    assert f32.model.weights == "float32" and f32.spec_hash() == plain.spec_hash()
    with pytest.raises(SpecError, match="model.weights"):
        load_spec(None, base_overrides(tmp_path, **{"model.weights": "q4"}))
    # what no worker could load is refused when the spec is read, not when a worker takes the job
    with pytest.raises(SpecError, match="as_stored' runs in float32 .* not in bfloat16"):
        load_spec(None, base_overrides(tmp_path, **{"model.weights": "as_stored", "model.dtype": "bfloat16"}))
    with pytest.raises(SpecError, match="tiny-random' is a random float32 model"):
        load_spec(None, base_overrides(tmp_path, **{"model.weights": "as_stored", "model.name": "tiny-random"}))
    assert load_spec(None, base_overrides(tmp_path, **{"model.weights": "float32", "model.dtype": "bfloat16"}))
    seen = {}
    import racer_batch.models as models
    from racer_batch.service.execution.runner import default_loader

    monkeypatch.setattr(models, "load_model", lambda name, **kw: seen.update(kw, name=name) or "bundle")
    real = f32.model.model_copy(update={"name": "smollm2-135m"})
    assert default_loader(real, allow_remote_code=False, device="cpu") == "bundle"
    assert seen["weights"] == "float32"


def test_prompt_rows_follow_the_models_chat_template_under_auto():
    """``input.prompt_format`` auto (the default) keeps a `prompt` row both ways; the worker answers the chat
    messages where the model has a chat template and the raw text where it has none (a base model). chat and
    raw keep one form."""
    from types import SimpleNamespace

    from racer_batch.service.execution.runner import _prompt_of
    from racer_batch.service.job.rows import parse_row
    from racer_batch.service.job.spec import JobSpec

    def engine(template):
        return SimpleNamespace(bundle=SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template)))

    for fmt, has_raw, has_chat in (("auto", True, True), ("chat", False, True), ("raw", True, False)):
        spec = JobSpec.model_validate({"input": {"path": "x.jsonl", "prompt_format": fmt}, "output": {"path": "o"}})
        task = parse_row(spec, 0, {"id": "a", "prompt": "Hello"})
        assert (task.raw is not None, task.chat is not None) == (has_raw, has_chat), fmt
        with_template, without = _prompt_of(task, engine("{{ x }}")), _prompt_of(task, engine(None))
        if fmt == "auto":
            assert with_template == [{"role": "user", "content": "Hello"}] and without == "Hello"
        elif fmt == "chat":
            assert with_template == without == [{"role": "user", "content": "Hello"}]
        else:
            assert with_template == without == "Hello"


def test_the_auto_prompt_format_keeps_the_spec_hash_of_the_old_chat_default():
    from racer_batch.service.job.spec import JobSpec

    def h(**inp):
        return JobSpec.model_validate({"input": {"path": "x.jsonl", **inp}, "output": {"path": "o"}}).spec_hash()

    assert h() == h(prompt_format="auto") == h(prompt_format="chat") != h(prompt_format="raw")


def test_shipped_presets_resolve_from_any_folder(tmp_path, monkeypatch):
    """The presets ship inside the package: ``ar`` (the shadow baseline) resolves with the working folder far from
    the repository, a user's own ``./configs/<name>.yaml`` still wins, and an unknown name lists the shipped
    ones."""
    from racer_batch.report.shadow_run import baseline_config
    from racer_batch.service.job.spec import SpecError, resolve_preset, shipped_presets

    monkeypatch.chdir(tmp_path)
    assert {"ar", "pld", "racer-cpu", "racer-paper"} <= set(shipped_presets())
    assert resolve_preset("ar", None).parent.name == "presets"
    assert baseline_config("ar").method == "ar"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "ar.yaml").write_text("decoding: {method: pld}\n")
    assert resolve_preset("ar", None) == tmp_path / "configs" / "ar.yaml"
    with pytest.raises(SpecError, match="shipped: ar, pld, racer-cpu, racer-paper"):
        resolve_preset("no-such-preset", None)


def test_an_input_of_an_unsupported_kind_names_the_supported_ones(tmp_path):
    """A CSV file (the trial's case) is refused with the formats that are read and a way to convert it, not an
    opaque list holding None; Parquet and JSON Lines mixed in one folder are told apart from that."""
    from racer_batch.service.job.inputs import InputError, plan_input
    from racer_batch.service.job.spec import InputSpec

    (tmp_path / "rows.csv").write_text("id,prompt\na,hello\n")
    with pytest.raises(InputError) as err:
        plan_input(InputSpec(path=str(tmp_path / "rows.csv")))
    msg = str(err.value)
    assert ".csv" in msg and "Parquet" in msg and "JSON Lines" in msg and "None" not in msg, msg
    assert "pyarrow.csv.read_csv" in msg
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    write_parquet(mixed / "b.parquet", [{"id": "b", "prompt": "y"}])
    with pytest.raises(InputError, match="mix Parquet and JSON Lines"):
        plan_input(InputSpec(path=str(mixed)))
