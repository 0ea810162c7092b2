"""Tests of tooling.trainer: corpus split and settings here, the whole recipe in the probe env.

The recipe needs torch, transformers, tokenizers and the reference ``dflash``
package, which the project's own environment lacks: those tests run in the
probe interpreter with ``dflash`` on its path (conftest's ``probe_python`` and
``dflash_path``). The smoke preset trains a tiny target and drafter on the CPU.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import (
    EnvironmentProblem,
    ToolingError,
    TrainingError,
    TrainSettingsError,
    error_for_exit_code,
)
from tooling.trainer import config as trainer_config
from tooling.trainer import corpus
from tooling.trainer.api import TrainedPair, TrainRequest, train_in

REPO = Path(__file__).resolve().parents[1]


# --- corpus and settings: standard library only ------------------------------------------


def _tree(tmp_path: Path, names: list[str]) -> Path:
    root = tmp_path / "stdlib"
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\nx = {len(name)}\n", encoding="utf-8")
    return root


def test_split_depends_on_path_and_seed_only(tmp_path: Path) -> None:
    names = [f"pkg{i % 7}/mod{i}.py" for i in range(300)]
    root = _tree(tmp_path, [*names, "site-packages/evil.py", "__pycache__/x.py"])
    full = corpus.load_corpus(root, seed=3, heldout_fraction=0.1, draft_fraction=0.2)
    again = corpus.load_corpus(root, seed=3, heldout_fraction=0.1, draft_fraction=0.2)
    subset = corpus.load_corpus(
        root, seed=3, heldout_fraction=0.1, draft_fraction=0.2, max_files=60
    )
    assert full.digest == again.digest
    assert [f.relpath for f in full.files] == sorted(names)  # third-party and caches skipped
    split_of = {f.relpath: f.split for f in full.files}
    assert len(subset.files) == 60
    assert all(split_of[f.relpath] == f.split for f in subset.files)
    stats = full.stats()
    assert {s: stats[s]["files"] for s in corpus.SPLITS} == {
        s: sum(1 for f in full.files if f.split == s) for s in corpus.SPLITS
    }
    # Each split gets roughly its share, and another seed gives another split.
    assert 10 <= stats[corpus.HELDOUT]["files"] <= 55
    assert 30 <= stats[corpus.DRAFT]["files"] <= 95
    other = corpus.load_corpus(root, seed=4, heldout_fraction=0.1, draft_fraction=0.2)
    assert other.digest != full.digest


def test_unreadable_files_are_skipped(tmp_path: Path) -> None:
    root = _tree(tmp_path, ["a.py"])
    (root / "latin1.py").write_bytes(b"# caf\xe9\n")
    (root / "empty.py").write_bytes(b"\n")
    loaded = corpus.load_corpus(root, seed=0, heldout_fraction=0.0, draft_fraction=0.0)
    assert [f.relpath for f in loaded.files] == ["a.py"]
    assert loaded.skipped == 2


def test_overrides_and_digest() -> None:
    base = trainer_config.PRESETS["full"]
    changed = trainer_config.apply_overrides(
        base,
        [
            "target_layer_ids=1,3,5",
            "max_files=none",
            "drafter_lr=5e-4",
            "drafter-layer-types=sliding_attention,full_attention",
        ],
    )
    assert changed.target_layer_ids == (1, 3, 5)
    assert changed.max_files is None
    assert changed.drafter_lr == 5e-4
    assert changed.drafter_layer_types == ("sliding_attention", "full_attention")
    digest = trainer_config.recipe_digest(base, "c", "k")
    assert digest == trainer_config.recipe_digest(base, "c", "k")
    assert digest != trainer_config.recipe_digest(changed, "c", "k")
    assert digest != trainer_config.recipe_digest(base, "c2", "k")
    with pytest.raises(ValueError):
        trainer_config.apply_overrides(base, ["no_such_setting=1"])
    with pytest.raises(ValueError):
        trainer_config.apply_overrides(base, ["target_layer_ids=1,9"]).validate()
    for preset in trainer_config.PRESETS.values():
        preset.validate()


# --- the recipe in the probe interpreter ------------------------------------------------


def _run(
    python: str, env: dict[str, str], args: list[str], timeout: int = 120
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [python, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def smoke_run(
    tmp_path_factory: pytest.TempPathFactory, probe_env: tuple[str, dict[str, str]]
) -> dict[str, Any]:
    python, env = probe_env
    cache = tmp_path_factory.mktemp("trainer-cache")
    export = cache / "export"
    request = TrainRequest(preset="smoke", cache_dir=cache, export=export)
    with pytest.MonkeyPatch.context() as mp:
        for key in ("PYTHONPATH", "TOKENIZERS_PARALLELISM"):
            mp.setenv(key, env[key])
        pair = train_in(Path(python), request)
        again = train_in(Path(python), request)
    return {
        "python": python,
        "env": env,
        "cache": cache,
        "export": export,
        "pair": pair,
        "again": again,
        "summary": json.loads(pair.summary.read_text()),
    }


def _decreasing(curve: list[list[float]]) -> bool:
    values = [v for _, v in curve]
    return len(values) >= 2 and all(math.isfinite(v) for v in values) and values[-1] < values[0]


@pytest.mark.slow
def test_smoke_recipe_trains_and_measures(smoke_run: dict[str, Any]) -> None:
    s = smoke_run["summary"]
    cfg = trainer_config.PRESETS["smoke"]
    pair = smoke_run["pair"]
    assert pair == TrainedPair.from_summary(s, cached=False)
    assert pair.output_dir == smoke_run["cache"] / "trained" / pair.recipe_digest
    assert smoke_run["again"] == TrainedPair.from_summary(s, cached=True)  # reused, not retrained
    assert s["preflight"]["equivalence_max_abs_diff"] < 1e-4
    assert _decreasing(s["target"]["loss_curve"])
    assert _decreasing(s["drafter"]["loss_curve"])
    for value in s["target"]["eval_loss_bf16"].values():
        assert math.isfinite(value) and 0 < value < math.log(cfg.vocab_size) + 1
    assert s["target"]["steps"] == cfg.target_max_steps
    assert s["drafter"]["steps"] == cfg.drafter_steps
    ref = s["reference"]
    assert ref["loop"] == "dflash.model.dflash_generate"
    assert ref["num_prompts"] == cfg.num_prompts
    assert 1.0 <= ref["mean_acceptance_length"] <= cfg.block_size
    per_pos = ref["acceptance_per_position"]
    assert len(per_pos) == cfg.block_size - 1
    assert all(0 <= b <= a <= 1 for a, b in itertools.pairwise(per_pos))
    assert math.isclose(ref["mean_acceptance_length"], 1 + sum(per_pos), rel_tol=1e-9)
    # Speculative decoding is lossless: the same tokens as plain greedy decoding.
    assert ref["plain_greedy_equal"] == cfg.num_prompts
    assert ref["crosscheck_minimal_loop"]["outputs_equal"] == cfg.crosscheck_prompts
    assert s["reload"]["drafter_layer_windows"] == [cfg.sliding_window, cfg.sliding_window, None]
    assert not s["reload"]["drafter_has_embeddings"]
    exported = {p.name for p in smoke_run["export"].iterdir()}
    assert exported == {"summary.json", "prompts.json", "reference.json", "train.log"}


@pytest.mark.slow
def test_smoke_outputs_are_consistent(smoke_run: dict[str, Any]) -> None:
    s = smoke_run["summary"]
    cfg = trainer_config.PRESETS["smoke"]
    prompts = json.loads(Path(s["paths"]["prompts"]).read_text())
    reference = json.loads(Path(s["paths"]["reference"]).read_text())
    assert len(prompts["prompts"]) == cfg.num_prompts
    assert all(len(p["token_ids"]) == cfg.prompt_len for p in prompts["prompts"])
    assert len({(p["file"], p["token_offset"]) for p in prompts["prompts"]}) == cfg.num_prompts
    heldout = json.loads(Path(s["paths"]["prompts"]).read_text())["prompts"][0]["file"]
    assert heldout.endswith(".py")
    for entry in reference["prompts"]:
        assert len(entry["output_ids"]) == cfg.max_new_tokens
        assert sum(entry["acceptance_lengths"]) == cfg.max_new_tokens - 1  # first from prefill
        assert all(
            0 <= a <= d
            for a, d in zip(entry["accepted_per_step"], entry["drafted_per_step"], strict=True)
        )


@pytest.mark.slow
def test_smoke_weights_reload_in_vllm_layout(smoke_run: dict[str, Any]) -> None:
    s = smoke_run["summary"]
    script = f"""
import json, torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, AutoConfig
from dflash.model import DFlashDraftModel
t, d = {s["paths"]["target"]!r}, {s["paths"]["drafter"]!r}
target = AutoModelForCausalLM.from_pretrained(t)
drafter, info = DFlashDraftModel.from_pretrained(d, output_loading_info=True)
tok = AutoTokenizer.from_pretrained(t)
with safe_open(d + "/model.safetensors", framework="pt") as f:
    keys = sorted(f.keys()); dtypes = sorted({{str(f.get_tensor(k).dtype) for k in keys}})
with safe_open(t + "/model.safetensors", framework="pt") as f:
    tdtypes = sorted({{str(f.get_tensor(k).dtype) for k in f.keys()}})
cfg = json.load(open(d + "/config.json"))
print(json.dumps({{"target": type(target).__name__, "keys": keys, "dtypes": dtypes,
    "tdtypes": tdtypes, "missing": sorted(info["missing_keys"]),
    "unexpected": sorted(info["unexpected_keys"]),
    "cfg": cfg, "eos": tok.eos_token_id, "mask": tok.mask_token_id,
    "roundtrip": tok.decode(tok.encode("def f(x):\\n    return x\\n"))}}))
"""
    out = json.loads(_run(smoke_run["python"], smoke_run["env"], ["-c", script]).stdout)
    cfg = trainer_config.PRESETS["smoke"]
    assert out["target"] == "Qwen3ForCausalLM"
    assert out["dtypes"] == ["torch.bfloat16"] and out["tdtypes"] == ["torch.bfloat16"]
    assert not out["missing"] and not out["unexpected"]
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= set(out["keys"])
    assert all(k.split(".")[0] in {"fc", "hidden_norm", "norm", "layers"} for k in out["keys"])
    c = out["cfg"]
    assert c["architectures"] == ["DFlashDraftModel"]
    assert c["layer_types"] == list(cfg.drafter_layer_types)
    assert c["use_sliding_window"] is True and c["sliding_window"] == cfg.sliding_window
    assert c["max_window_layers"] == len(cfg.drafter_layer_types)
    assert c["num_target_layers"] == cfg.target_layers
    assert c["dflash_config"] == {
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": 1,
        "block_size": cfg.block_size,
    }
    assert (out["eos"], out["mask"]) == (0, 1)
    assert out["roundtrip"] == "def f(x):\n    return x\n"


@pytest.mark.slow  # the recipe in the probe environment
def test_split_and_tokenizer_are_deterministic(probe_env: tuple[str, dict[str, str]]) -> None:
    python, env = probe_env
    args = [
        "-c",
        "import json; from tooling.trainer.config import PRESETS; "
        "from tooling.trainer.recipe import digest_info; "
        "print(json.dumps(digest_info(PRESETS['smoke'], True)))",
    ]
    first = json.loads(_run(python, env, args).stdout)
    second = json.loads(_run(python, env, args).stdout)
    assert first == second
    assert len(first["tokenizer_digest"]) == 64
    assert first["tokenizer_vocab_size"] <= trainer_config.PRESETS["smoke"].vocab_size
    assert len(first["split_digest"]) == 64 and len(first["recipe_digest"]) == 16


_UNIT_SCRIPT = """
import torch
from tooling.trainer.config import PRESETS
from tooling.trainer.drafter import (block_labels, build_drafter, check_equivalence,
    drafter_config, multi_block_hidden, block_layer_mask)
from tooling.trainer.reference_accept import dflash_run, minimal_run
from tooling.trainer.target import build_target, target_config
import tooling.trainer.drafter as dr

cfg = PRESETS["smoke"]
tconf = target_config(cfg, 300)
target = build_target(tconf, 0, torch.device("cpu")).eval()
drafter = build_drafter(drafter_config(cfg, tconf, 1), 1, torch.device("cpu")).eval()
g = torch.Generator().manual_seed(0)
ctx = torch.randn(2, 48, 3 * cfg.hidden_size, generator=g)
noise = torch.randn(2, 6 * cfg.block_size, cfg.hidden_size, generator=g)
anchors = torch.stack([torch.randperm(30, generator=g)[:6] + 14 for _ in range(2)])
good = check_equivalence(drafter, ctx, noise, anchors)

# Negative control: the same check with sliding layers given the full-attention mask.
real = dr.block_layer_mask
dr.block_layer_mask = lambda a, n, b, causal, window: real(a, n, b, False, None)
bad = check_equivalence(drafter, ctx, noise, anchors)
dr.block_layer_mask = real

tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
greedy = torch.tensor([[6, 7, 0, 9, 10, 11, 12, 13]])  # wrong guess for position 3 only
labels, valid = block_labels(tokens, greedy, torch.tensor([[0, 2]]), 4)

prompt = torch.randint(2, 300, (40,), generator=g).tolist()
a = dflash_run(target, drafter, prompt, 13)
b = minimal_run(target, drafter, prompt, 13)
import json
print(json.dumps({"good": good, "bad": bad, "labels": labels.tolist(), "valid": valid.tolist(),
    "same_out": a.output_ids == b.output_ids, "a": [a.drafted, a.accepted, a.produced],
    "b": [b.drafted, b.accepted, b.produced], "block_size": drafter.block_size}))
"""


@pytest.mark.slow  # the recipe in the probe environment
def test_multi_block_training_forward_matches_reference(
    probe_env: tuple[str, dict[str, str]],
) -> None:
    python, env = probe_env
    out = json.loads(_run(python, env, ["-c", _UNIT_SCRIPT]).stdout)
    assert out["good"] < 1e-5
    assert out["bad"] > 1e-2  # the check would see a wrong sliding-window mask
    # Labels are greedy[a .. a+2]; the block at 2 leaves the greedy chain at once
    # (tokens[3] = 8, greedy[2] = 0), so only its first label is known.
    assert out["labels"] == [[[6, 7, 0], [0, 9, 10]]]
    assert out["valid"] == [[[True, True, True], [True, False, False]]]
    assert out["same_out"]
    # Steps rebuilt from dflash's stats equal the exact counts until dflash clips its block
    # to what max_new leaves; the minimal loop drafts whole blocks to the end, as vLLM does.
    a, b, whole = out["a"], out["b"], out["block_size"] - 1
    clipped = next(i for i, d in enumerate(a[0]) if d < whole)
    assert clipped > 0 and [x[:clipped] for x in a] == [x[:clipped] for x in b]
    assert set(b[0]) == {whole}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


def test_trainer_imports_nothing_else_from_tooling() -> None:
    """The trainer runs on a GPU host with only its own few dependencies: of tooling it
    imports errors, paths, procs, schema, fsutil and entry (how its entry speaks), which need
    the standard library alone."""
    allowed = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "dflash"}
    allowed |= set(sys.stdlib_module_names)
    shared = {"errors", "paths", "procs", "schema", "fsutil", "entry"}
    for path in (REPO / "tooling" / "trainer").glob("*.py"):
        for level, name in _imports(path):
            if level == 0:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
            elif level == 2:
                assert name in shared, f"{path.name} imports tooling.{name}"
    for name in shared:
        for level, module in _imports(REPO / "tooling" / f"{name}.py"):
            assert (level, module) in {(1, "errors")} or (
                level == 0 and module.split(".")[0] in sys.stdlib_module_names
            ), f"tooling/{name}.py imports {module}"


# --- tooling train: bad input is one line with tooling's exit code -----------------------


def _train(*args: str) -> Any:
    return CliRunner().invoke(main, ["train", *args])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "no_such_setting=1"],
            "error: recipe settings: --set 'no_such_setting=1': expected KEY=VALUE with KEY one "
            "of the settings\n",
        ),
        (
            ["--preset", "smoke", "--set", "sliding_window=2"],
            "error: recipe settings: sliding_window must be at least block_size\n",
        ),
        (
            ["--preset", "huge"],
            "error: --preset 'huge': not one of full, hybrid, hybrid-smoke, smoke\n",
        ),
        (
            # vLLM would split the drafter over KV-cache groups and refuse to start.
            [
                "--arch",
                "hybrid",
                "--set",
                "target_layers=16",
                "--set",
                "target_layer_ids=1,4,7,10,13",
            ],
            "error: recipe settings: a hybrid target of 16 layers has 4 attention layers, "
            "fewer than the drafter's 5\n",
        ),
        (
            ["--set", "block_size=four"],
            "error: recipe settings: --set 'block_size=four': block_size takes int\n",
        ),
        (
            ["--set", "target_layer_ids=1,x"],
            "error: recipe settings: --set 'target_layer_ids=1,x': target_layer_ids takes "
            "tuple[int, ...]\n",
        ),
        # Was a ZeroDivisionError (exit 1) checking num_heads % num_kv_heads.
        (["--set", "num_kv_heads=0"], "error: recipe settings: num_kv_heads 0: must be above 0\n"),
        (
            ["--set", "target_time_cap_s=-5"],
            "error: recipe settings: target_time_cap_s -5.0: must not be negative\n",
        ),
    ],
)
def test_train_refuses_bad_settings_before_starting_anything(args: list[str], message: str) -> None:
    result = _train("--python", "/bin/false", *args)
    # Refused here: /bin/false, which would answer nothing, is never started.
    assert result.exit_code == TrainSettingsError.exit_code == 21
    assert result.stderr == message


def test_train_in_an_interpreter_without_torch_is_one_environment_line() -> None:
    """The toolchain's own interpreter has no torch: the child says so through its outcome."""
    result = _train("--python", sys.executable, "--preset", "smoke", "--json")
    assert result.exit_code == EnvironmentProblem.exit_code == 18
    assert result.stderr.startswith("error: missing Python packages: torch, ")
    assert result.stderr.count("\n") == 1
    assert json.loads(result.stdout) == {
        "ok": False,
        "error": result.stderr.removeprefix("error: ").strip(),
        "exit_code": 18,
    }


def test_train_in_an_interpreter_that_reports_nothing_is_a_training_error() -> None:
    result = _train("--python", "/bin/true", "--preset", "smoke")
    assert result.exit_code == TrainingError.exit_code == 22
    assert result.stderr == (
        "error: the training recipe in /bin/true exited 0 without a result (its output is above)\n"
    )


def test_a_childs_exit_code_is_raised_again_as_its_error() -> None:
    """Every code is declared once; a class that keeps its parent's code comes back as the
    class that declared it."""
    classes = [ToolingError, *_subclasses(ToolingError)]
    declared = [c for c in classes if "exit_code" in vars(c)]
    codes = [c.exit_code for c in declared]
    assert len(set(codes)) == len(codes), "exit codes must be distinct"
    for cls in classes:
        error = error_for_exit_code(cls.exit_code, "m")
        owner = next(c for c in cls.__mro__ if "exit_code" in vars(c))
        assert type(error) is owner and str(error) == "m"


def _subclasses(cls: type) -> list[type]:
    return [s for c in cls.__subclasses__() for s in (c, *_subclasses(c))]


def test_an_out_dir_holding_the_users_files_is_refused_and_kept(tmp_path: Path) -> None:
    """A finished run replaces its folder whole: ``--out-dir`` on a folder of the user's
    would have deleted what it held."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "summary.json").write_text("{}")  # a run's own name is no reason to refuse
    result = _train("--python", "/bin/false", "--preset", "smoke", "--out-dir", str(mine))
    assert result.exit_code == TrainSettingsError.exit_code
    assert result.stderr == (
        f"error: --out-dir {mine}: holds notes.txt, which no run writes, and a run replaces "
        "the folder whole: give a new or empty folder\n"
    )
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "summary.json"]
    assert (mine / "notes.txt").read_text() == "keep me"


def test_the_entries_an_out_dir_may_hold_are_the_run_folders_own() -> None:
    """``api.RUN_ENTRIES`` (checked in the parent, which imports no recipe) names the files
    ``recipe.RunPaths`` writes: a new one missing there would refuse a run's own folder."""
    from tooling.trainer.api import RUN_ENTRIES
    from tooling.trainer.recipe import RunPaths

    paths = RunPaths(Path("run"))
    names = [n for n, v in vars(RunPaths).items() if isinstance(v, property)]
    assert {getattr(paths, n).name for n in names} == RUN_ENTRIES
