"""``tooling bundle`` before anything is written: sizes, platforms, present lists, the
lock's closure and the plan, checked against real data (the 0.20.1 runtime lock and the
wheels one offline H200 host lacked, ``tests/data``) so a bundle carries what a host needs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tooling.errors import BundleError, exit_code_for
from tooling.fetching.bases import load_bases
from tooling.paths import REPO_DIR
from tooling.release.bundle import make_bundle, read_present
from tooling.release.bundle_plan import (
    DEFAULT_SKIP,
    BundleConfig,
    default_bundle_name,
    exclude_newer_for,
    is_present,
    parse_present,
    parse_size,
    plan_bundle,
    skip_closure,
)
from tooling.release.download import platform_tags, resolve, uv_platform
from tooling.release.lock import parse_lock

from .wheels import build_wheel

DATA = Path(__file__).parent / "data"
LOCK = DATA / "vllm-0.20.1-runtime-lock.txt"
CARRIED = DATA / "carried-to-gpu-host-2026-11-29.txt"
PATCHED_NAME = "vllm-0.20.1+dflash-1-cp38-abi3-manylinux_2_35_x86_64.whl"


def _pins(text: str) -> set[tuple[str, str]]:
    return {(r.name, r.version) for r in parse_lock(text)}


def test_sizes() -> None:
    assert parse_size("60M") == 60 * 1024 * 1024
    assert parse_size("1G") == 1 << 30
    assert parse_size("512k") == 512 * 1024
    assert parse_size("60MiB") == 60 << 20
    assert parse_size("4096") == 4096
    for bad in ("0", "sixty", "60T", "-1M"):
        with pytest.raises(BundleError, match="--split"):
            parse_size(bad)


def test_platform_tags_cover_older_glibc_and_aliases() -> None:
    tags = platform_tags("manylinux_2_35_x86_64")
    assert tags[0] == "manylinux_2_35_x86_64"
    assert "manylinux_2_17_x86_64" in tags and "manylinux_2_5_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_36_x86_64" not in tags
    assert uv_platform("manylinux_2_35_x86_64") == "x86_64-manylinux_2_35"
    with pytest.raises(BundleError, match="platform"):
        platform_tags("linux_x86_64")


def test_cutoff_of_0201_is_the_one_the_release_lock_used() -> None:
    base = load_bases(REPO_DIR / "patches" / "bases.toml").get("0.20.1")
    assert exclude_newer_for(base) == "2026-05-06"


def test_a_request_fills_the_bundles_defaults_from_dist_and_base(tmp_path) -> None:
    from tooling.release.bundle_plan import DEFAULT_EXTRAS
    from tooling.release.request import BundleRequest

    dist = tmp_path / "dist"
    dist.mkdir()
    wheel = build_wheel(dist, "vllm", "0.20.1+dflash.6.abc")
    base = load_bases(REPO_DIR / "patches" / "bases.toml").get("0.20.1")
    request = BundleRequest(
        wheel=None,
        dist_dir=dist,
        out_dir=tmp_path / "out",
        base=base,
        index_url="https://example.invalid/simple",
        download_dir=tmp_path / "wheels",
        split="60M",
    )
    config = request.config()
    assert config.wheel == wheel.resolve()  # the one wheel in --dist
    assert config.exclude_newer == "2026-05-06"  # the base's release date
    assert config.extras == DEFAULT_EXTRAS
    assert config.split_bytes == 60 * 2**20
    given = BundleRequest(**{**vars(request), "exclude_newer": "2026-06-01", "extras": ("x",)})
    assert (given.config().exclude_newer, given.config().extras) == ("2026-06-01", ("x",))


def test_present_lists_in_every_shape() -> None:
    present = parse_present(
        "# pip freeze\n"
        "torch==2.11.0+cu130\n"
        "Transformers==5.17.0\n"
        "vllm @ file:///opt/wheels/vllm-0.20.1.whl\n"
        "-e git+https://example.invalid/x.git#egg=x\n"
        "numpy\n"
        "cbor2-6.0.1-cp312-cp312-manylinux_2_28_x86_64.whl\n"
        "Package    Version\n"
        "---------- -------\n"
        "safetensors 0.7.0\n"
    )
    assert present == {
        "torch": "2.11.0+cu130",
        "transformers": "5.17.0",
        "vllm": None,
        "numpy": None,
        "cbor2": "6.0.1",
        "safetensors": "0.7.0",
    }
    with pytest.raises(BundleError, match="cannot read the line"):
        parse_present("torch >= 2 , but newer\n")


def test_presence_matches_public_versions_only() -> None:
    present = parse_present("torch==2.11.0+cu130\ntransformers==5.17.0\nnumpy\n")
    assert is_present("torch", "2.11.0", present)  # the host's CUDA build is the same release
    assert not is_present("transformers", "5.8.0", present)  # carried, as on the H200 host
    assert is_present("numpy", "2.3.5", present)  # a bare name: any version
    assert not is_present("pydantic", "2.13.4", present)


def test_lock_parsing_reads_versions_and_via() -> None:
    requirements = parse_lock(LOCK.read_text())
    assert len(requirements) == 180
    by_name = {r.name: r for r in requirements}
    assert by_name["vllm"].version == "0.20.1" and by_name["vllm"].via == ("-r",)
    assert by_name["torch"].version == "2.11.0"
    assert by_name["nvidia-cutlass-dsl-libs-base"].via == ("nvidia-cutlass-dsl",)
    assert by_name["torch-c-dlpack-ext"].via == ("quack-kernels", "tilelang")
    assert set(by_name["apache-tvm-ffi"].via) >= {"vllm", "xgrammar"}


def test_skipping_drops_what_only_skipped_packages_need() -> None:
    dropped = skip_closure(parse_lock(LOCK.read_text()), DEFAULT_SKIP)
    assert set(DEFAULT_SKIP) <= set(dropped)
    assert dropped["nvidia-cutlass-dsl-libs-base"] == "only needed by nvidia-cutlass-dsl"
    assert dropped["z3-solver"] == "only needed by tilelang"
    assert "apache-tvm-ffi" not in dropped  # vLLM itself needs it
    assert "torch-c-dlpack-ext" not in dropped  # kept: tvm_ffi JIT-builds it otherwise
    assert "torch" not in dropped


def test_plan_reproduces_the_wheels_one_host_lacked() -> None:
    """The host had everything of the closure except the 90 carried wheels."""
    requirements = parse_lock(LOCK.read_text())
    carried = parse_present(CARRIED.read_text())  # wheel names -> versions
    host_has = "\n".join(r.name for r in requirements if r.name not in carried)
    plan = plan_bundle(
        requirements,
        wheel=Path("/dist") / PATCHED_NAME,
        present=parse_present(host_has),
    )
    planned = {e.name: e.version for e in plan.include}
    assert set(planned) == set(carried)
    for name, version in carried.items():
        if name != "vllm":
            assert planned[name] == version, name
    vllm = next(e for e in plan.include if e.name == "vllm")
    assert (vllm.source, vllm.version, vllm.path) == (
        "patched",
        "0.20.1+dflash",
        f"/dist/{PATCHED_NAME}",
    )
    assert next(e for e in plan.include if e.name == "dflash").source == "extra"


def test_plan_with_a_freeze_carries_mismatched_versions() -> None:
    requirements = parse_lock(LOCK.read_text())
    freeze = "\n".join(f"{r.name}=={r.version}" for r in requirements if r.name != "transformers")
    freeze += "\ntransformers==5.17.0\ntorch==2.11.0+cu130\n"
    plan = plan_bundle(
        requirements, wheel=Path(PATCHED_NAME), present=parse_present(freeze), extras=()
    )
    assert sorted(e.name for e in plan.include) == ["transformers", "vllm"]
    assert ("torch", "2.11.0") in plan.present


def test_plan_refuses_an_unpinned_extra() -> None:
    with pytest.raises(BundleError, match="name==version"):
        plan_bundle([], wheel=Path(PATCHED_NAME), extras=("dflash",))


def test_missing_wheel_is_one_clear_error(tmp_path: Path) -> None:
    config = BundleConfig(wheel=tmp_path / "nope.whl", out_dir=tmp_path, exclude_newer="2026-05-06")
    with pytest.raises(BundleError, match="no such wheel"):
        resolve(config)
    with pytest.raises(BundleError, match="cannot read the exclude-present list"):
        read_present(tmp_path / "absent.txt")


@pytest.mark.parametrize("left", ["{name}", "{name}-parts"])
def test_an_earlier_bundle_in_out_is_refused_before_any_work(tmp_path: Path, left: str) -> None:
    """The second run into one --out resolved, downloaded and copied everything, then failed
    renaming onto the first bundle (an unexpected OSError, exit 1)."""
    wheel = build_wheel(tmp_path, "vllm_standin", "0.20.1+dflash", "sniffio")
    config = BundleConfig(wheel=wheel, out_dir=tmp_path / "out", exclude_newer="2026-05-06")
    earlier = config.out_dir / left.format(name=default_bundle_name(config))
    earlier.mkdir(parents=True)
    (earlier / "install.sh").write_text("# the user's\n")
    with pytest.raises(BundleError) as e:
        make_bundle(config)
    assert str(e.value) == f"{earlier} exists (an earlier bundle?): move it away, or give --out"
    assert exit_code_for(e.value) == 19
    assert [p.name for p in config.out_dir.iterdir()] == [earlier.name]
    assert (earlier / "install.sh").read_text() == "# the user's\n"


@pytest.mark.slow
def test_resolution_matches_the_release_lock(tmp_path: Path, upstream_0201) -> None:
    """uv on the official 0.20.1 wheel + torch==2.11.0 gives the recorded closure (network)."""
    official = upstream_0201.wheel
    config = BundleConfig(wheel=official, out_dir=tmp_path, exclude_newer="2026-05-06")
    resolution = resolve(config)
    assert _pins(resolution.lock_text) == _pins(LOCK.read_text())
    torch = next(r for r in resolution.requirements if r.name == "torch")
    assert torch.hashes and all(len(h) == 64 for h in torch.hashes)
    assert f"./wheels/{official.name}" in resolution.lock_text
    assert (
        str(tmp_path) not in resolution.lock_text
        and "/tmp/bundle-resolve" not in resolution.lock_text
    )
