"""The GPU check's Python steps: import checks, versions, the signal probe, the summary.

``scripts/gpu-check.sh`` runs each as its own process under its own timeout:

* ``imports SITE LIST``: import every module named in ``LIST``
  (``scripts/gpu-wheels.txt``) and say whether it came from the carried wheels in
  ``SITE``; exit 1 naming each one that fails.
* ``versions WORK``: the NVIDIA driver (``nvidia-smi`` and ``cuDriverGetVersion``),
  Python and the packages that matter, to ``WORK/versions.json``.
* ``probe WORK``: park a CUDA wait on asyncio (and uvloop where installed), and
  record from :func:`asyncfence.current_statistics` which wake path and which
  completion signal it used, to ``WORK/probe.json``.
* ``note WORK NAME KEY=VALUE...``: write ``WORK/NAME.json`` for the shell's own
  steps (``true``, ``false``, ``null`` and integers are converted).
* ``summary OUT WORK``: merge what the steps left in ``WORK`` with the test
  results (``OUT/tests.jsonl``, ``OUT/junit.xml``) into ``OUT/summary.json``.
  The script calls it after every step, so a later hang loses nothing earlier.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

#: Distributions whose versions the summary records (CuPy's name varies: any
#: distribution named ``cupy*`` is recorded too).
DISTRIBUTIONS = (
    "cuda-bindings",
    "cuda-core",
    "cuda-pathfinder",
    "cuda-python",
    "torch",
    "numba-cuda",
    "numba",
    "numpy",
    "anyio",
    "uvloop",
    "trio",
    "pytest",
    "pytest-asyncio",
    "pytest-timeout",
    "hypothesis",
    "rich",
    "matplotlib",
)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _write_json(path: Path, data: object) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return {"missing": f"{path.name}: {error}"}


# -- imports -------------------------------------------------------------------------


def imports(site: str, listing: Path) -> int:
    """Import each module ``listing`` names; report where each came from.

    Args:
        site: The folder the wheels were installed into ("" where none were).
        listing: ``scripts/gpu-wheels.txt``: ``distribution==version module`` lines.

    Returns:
        0 if every module imports, else 1.
    """
    failed = 0
    site_path = Path(site).resolve() if site else None
    for line in listing.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) != 2:
            continue
        requirement, module_name = fields
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # any failure to import is the finding
            print(f"gpu-check: cannot import {module_name} ({requirement}): {error!r}")
            failed = 1
            continue
        origin = Path(getattr(module, "__file__", None) or ".").resolve()
        carried = site_path is not None and site_path in origin.parents
        version = getattr(module, "__version__", "?")
        where = "the carried wheel" if carried else f"the machine ({origin.parent})"
        print(f"gpu-check: {module_name} {version} imports, from {where}")
    if site:
        for problem in _unmet_requirements(site):
            print(f"gpu-check: warning: {problem}")
    return failed


def _unmet_requirements(site: str) -> list[str]:
    """What the wheels installed in ``site`` require and this Python lacks."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return ["packaging is missing: the wheels' requirements were not checked"]
    problems = []
    for dist in importlib.metadata.distributions(path=[site]):
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                have = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} needs {requirement}, which is missing")
                continue
            if not requirement.specifier.contains(have, prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {requirement}; here it is {have}")
    return problems


# -- versions ------------------------------------------------------------------------


def _nvidia_smi() -> dict[str, Any]:
    if shutil.which("nvidia-smi") is None:
        return {"error": "no nvidia-smi on PATH"}
    query = "name,driver_version,memory.total"
    try:
        result = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": "nvidia-smi did not answer within 20 s"}
    if result.returncode != 0:
        return {"error": f"nvidia-smi exited {result.returncode}: {result.stderr.strip()}"}
    gpus = []
    for line in result.stdout.strip().splitlines():
        name, driver, memory = (part.strip() for part in line.split(",", 2))
        gpus.append({"name": name, "driver_version": driver, "memory": memory})
    return {"gpus": gpus, "driver_version": gpus[0]["driver_version"] if gpus else None}


def _cuda_driver_version() -> dict[str, Any]:
    try:
        from cuda.bindings import driver
    except ImportError as error:
        return {"error": f"cuda.bindings does not import: {error}"}
    try:
        code, version = driver.cuDriverGetVersion()
    except Exception as error:  # no libcuda: cuda.bindings raises its own errors
        return {"error": f"{type(error).__name__}: {error}"}
    if code != driver.CUresult.CUDA_SUCCESS:
        return {"error": f"cuDriverGetVersion returned {code!r}"}
    version = int(version)
    return {"version": version, "cuda": f"{version // 1000}.{version % 1000 // 10}"}


def _packages() -> dict[str, dict[str, str]]:
    wanted = {_normalized(name) for name in DISTRIBUTIONS}
    found: dict[str, dict[str, str]] = {}
    for dist in importlib.metadata.distributions():
        raw = dist.metadata["Name"]
        if not raw:
            continue
        name = _normalized(raw)
        if (name in wanted or name.startswith("cupy")) and name not in found:
            # The first found is the one imported: sys.path order.
            found[name] = {"version": dist.version, "location": str(dist.locate_file(""))}
    return dict(sorted(found.items()))


#: The oldest versions the check relies on (anyio 4.11: the tests' anyio_mode).
MINIMUM_VERSIONS = {
    "anyio": "4.11",
    "cuda-bindings": "12.6",
    "pytest": "8.2",
    "pytest-timeout": "2.3",
}


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"4.11.0rc1"`` gives (4, 11, 0)."""
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(numbers)


def _too_old(packages: dict[str, dict[str, str]]) -> list[str]:
    """Each package older than the check relies on, or missing, in words."""
    problems = []
    for name, minimum in MINIMUM_VERSIONS.items():
        have = packages.get(name, {}).get("version")
        if have is None:
            problems.append(f"{name} is missing (needs {minimum} or newer)")
        elif _release(have) < _release(minimum):
            problems.append(f"{name} is {have}; the check needs {minimum} or newer")
    return problems


def versions(work: Path) -> int:
    """Record the driver, Python and package versions in ``work/versions.json``.

    Returns:
        0, or 1 if ``cuDriverGetVersion`` failed (no usable driver) or a
        package is older than :data:`MINIMUM_VERSIONS` says.
    """
    import asyncfence

    cuda = _cuda_driver_version()
    packages = _packages()
    data = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "asyncfence": asyncfence.__version__,
        "asyncfence_path": str(Path(asyncfence.__file__).resolve().parent),
        "nvidia_smi": _nvidia_smi(),
        "cuDriverGetVersion": cuda,
        "packages": packages,
        "too_old": _too_old(packages),
    }
    _write_json(work / "versions.json", data)
    print(json.dumps(data, indent=2))
    for problem in data["too_old"]:
        print(f"gpu-check: {problem}", file=sys.stderr)
    return 1 if "error" in cuda or data["too_old"] else 0


# -- the signal probe ------------------------------------------------------------------


async def _parked_wait() -> dict[str, Any]:
    import asyncfence
    from asyncfence.testing import hold, open_default_device

    device = open_default_device("cuda")
    stream = device.new_stream()
    try:
        with hold(stream) as gate:
            fence = asyncfence.record(stream)
            waiter = asyncio.ensure_future(fence.wait(strategy="park"))
            deadline = time.monotonic() + 10
            while asyncfence.current_statistics().parked < 1:
                if waiter.done() or time.monotonic() > deadline:
                    waiter.cancel()
                    raise RuntimeError("the wait never parked (10 s)")
                await asyncio.sleep(0.001)
            parked = asyncfence.current_statistics()
            gate.release()
            await asyncio.wait_for(waiter, 10)
        after = asyncfence.current_statistics()
    finally:
        device.close_stream(stream)
    signal_paths = {stats.backend: stats.signal_path for stats in asyncfence.backend_statistics()}
    return {
        "wake_path": getattr(parked, "wake_path", None),
        "cuda_signal": signal_paths.get("cuda"),
        "parked": parked.parked,
        "armed": getattr(parked, "armed", None),
        "signals_after": getattr(after, "signals", None),
        "rechecks_after": getattr(after, "rechecks", None),
    }


def probe(work: Path) -> int:
    """Park a CUDA wait on each loop; record its wake path and completion signal.

    Returns:
        0, or 1 if a loop's probe failed.
    """
    from asyncfence import _native

    loops: dict[str, Any] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:
        pass
    else:
        loops["uvloop"] = uvloop.new_event_loop
    shim = _native.shim()
    data: dict[str, Any] = {
        "shim_loaded": None if shim is None else shim.path,
        "shim_unavailable_reason": _native.unavailable_reason(),
        "loops": {},
    }
    failed = 0
    for name, factory in loops.items():
        loop = factory()
        try:
            data["loops"][name] = loop.run_until_complete(_parked_wait())
        except Exception as error:  # recorded, and the next loop is tried
            data["loops"][name] = {"error": f"{type(error).__name__}: {error}"}
            failed = 1
        finally:
            loop.close()
    first = data["loops"].get("asyncio", {})
    data["wake_path"] = first.get("wake_path")
    data["cuda_signal"] = first.get("cuda_signal")
    _write_json(work / "probe.json", data)
    print(json.dumps(data, indent=2))
    return failed


# -- the summary -------------------------------------------------------------------------


def _steps(work: Path) -> dict[str, Any]:
    steps: dict[str, Any] = {}
    try:
        lines = (work / "steps.tsv").read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        name, status, limit, seconds = [*line.split("\t"), "", "", ""][:4]
        entry: dict[str, Any] = {"limit_s": int(limit or 0), "seconds": int(seconds or 0)}
        if status.lstrip("-").isdigit():
            code = int(status)
            entry["exit_code"] = code
            if code in (124, 137):
                entry["timed_out"] = True
        else:
            entry["status"] = status
        steps[name] = entry
    return steps


def _test_outcomes(lines: list[str]) -> tuple[dict[str, str], dict[str, Any]]:
    """Each test's outcome in the log's lines, and what else the log says."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    started: list[str] = []
    collect_errors: dict[str, str] = {}
    exitstatus = None
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        event, nodeid = entry.get("event"), entry.get("nodeid", "")
        if event == "start":
            started.append(nodeid)
        elif event == "collect":
            collect_errors[nodeid] = entry.get("message", "")
        elif event == "finish":
            exitstatus = entry.get("exitstatus")
        elif event == "phase":
            when, outcome = entry["when"], entry["outcome"]
            previous = outcomes.get(nodeid)
            if outcome == "failed":
                outcomes[nodeid] = "failed" if when == "call" else "error"
                messages[nodeid] = entry.get("message", "")
            elif outcome == "skipped" and previous is None:
                outcomes[nodeid] = "xfailed" if entry.get("xfail") else "skipped"
            elif outcome == "passed" and when == "call" and previous is None:
                outcomes[nodeid] = "xpassed" if entry.get("xfail") else "passed"
    rest = {
        "messages": messages,
        "started": started,
        "collect_errors": collect_errors,
        "exitstatus": exitstatus,
    }
    return outcomes, rest


def _tests_from_log(path: Path) -> dict[str, Any]:
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        return {"error": f"no test log: {error}"}
    outcomes, rest = _test_outcomes(lines)
    messages, started = rest["messages"], rest["started"]
    collect_errors, exitstatus = rest["collect_errors"], rest["exitstatus"]
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    unfinished = [nodeid for nodeid in started if nodeid not in outcomes]
    return {
        "counts": dict(sorted(counts.items())),
        "failed": {
            n: messages.get(n, "")[-600:]
            for n, o in outcomes.items()
            if o != "passed" and o not in ("skipped", "xfailed")
        },
        "collect_errors": collect_errors,
        "running_when_stopped": unfinished,
        "finished": exitstatus is not None,
        "exitstatus": exitstatus,
    }


def _junit(path: Path) -> dict[str, Any]:
    try:
        suite = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as error:
        return {"error": f"no junit report: {error}"}
    if suite.tag == "testsuites":
        found = suite.find("testsuite")
        if found is None:
            return {"error": "the junit report has no testsuite"}
        suite = found
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _skip_reasons(log: Path) -> dict[str, int]:
    reasons: dict[str, int] = {}
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return reasons
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("outcome") == "skipped" and "message" in entry:
            reason = entry["message"].removeprefix("Skipped: ")
            reasons[reason] = reasons.get(reason, 0) + 1
    return dict(sorted(reasons.items(), key=lambda item: -item[1]))


#: The tests of ``from_event`` on each library's CUDA events, and of PyTorch's
#: generic streams, by what they cover (a test name's prefix, in test_cuda.py).
STACK_TESTS = {
    "from_event(CUevent)": "test_an_adopted_cuevent",
    "from_event(cuda.core Event)": "test_a_cuda_core_event_is_adopted",
    "from_event(torch.cuda.Event, torch.Event)": "test_a_torch_event_is_adopted",
    "from_event(cupy.cuda.Event)": "test_a_cupy_event_is_adopted",
    "from_event(numba-cuda event)": "test_a_numba_event_is_adopted",
    "from_event refuses a captured event": "test_an_event_recorded_in_a_capture",
    "record(torch.Stream on CUDA)": "test_a_generic_torch_stream_on_cuda",
    "record(torch.accelerator.current_stream())": "test_torch_accelerator_current_stream",
}


def _stacks(out: Path) -> dict[str, Any]:
    """What ran of the other libraries' events and streams, and the blocking wait's rows."""
    try:
        lines = (out / "tests.jsonl").read_text().splitlines()
    except OSError as error:
        return {"error": f"no test log: {error}"}
    outcomes, _ = _test_outcomes(lines)
    tests: dict[str, dict[str, int]] = {}
    for covers, prefix in STACK_TESTS.items():
        counts: dict[str, int] = {}
        for nodeid, outcome in outcomes.items():
            if nodeid.rpartition("::")[2].startswith(prefix):
                counts[outcome] = counts.get(outcome, 0) + 1
        tests[covers] = dict(sorted(counts.items()))
    report = _read_json(out / "bench.json")
    summary = report.get("summary", {}) if isinstance(report, dict) else {}
    return {
        "tests": tests,
        "wait_sync": summary.get("wait_sync"),
        "wait_sync_cpu": summary.get("wait_sync_cpu"),
    }


#: The bench scenarios that run work on more streams at once than the driver's
#: default CUDA_DEVICE_MAX_CONNECTIONS (8): past it, streams share hardware
#: queues, so their work (and held streams) may serialise.
MANY_STREAM_SCENARIOS = ("wake_64_queues", "parked_queues", "throughput", "scale")


def _bench(out: Path, stem: str, step: dict[str, Any] | None) -> dict[str, Any] | None:
    """One bench run: its step, and which scenarios its JSON says it completed."""
    if step is None:
        return None
    found: dict[str, Any] = {**step, "json": f"{stem}.json"}
    report = _read_json(out / f"{stem}.json")
    meta = report.get("meta", {}) if isinstance(report, dict) else {}
    planned, completed = meta.get("scenarios", []), meta.get("completed", [])
    found["scenarios_completed"] = completed
    found["scenarios_missing"] = [key for key in planned if key not in completed]
    found["complete"] = bool(planned) and not found["scenarios_missing"]
    if "missing" in report:
        found["error"] = report["missing"]
    return found


def _hardware_queues(meta: dict[str, Any]) -> dict[str, Any]:
    connections = meta.get("CUDA_DEVICE_MAX_CONNECTIONS")
    limit = connections if isinstance(connections, int) else 8  # else the driver's default
    return {
        "CUDA_DEVICE_MAX_CONNECTIONS": connections,
        "note": (
            f"streams beyond {limit} share hardware queues: work in these scenarios, "
            "which use 64 streams or more, may serialise there"
        ),
        "scenarios_affected": list(MANY_STREAM_SCENARIOS),
    }


def _tail(path: Path, lines: int = 15) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def summary(out: Path, work: Path) -> int:
    """Write ``out/summary.json`` from what the steps have left so far.

    Returns:
        0 if every step ran and passed, else 1 (``failed_steps`` and
        ``skipped_steps`` say which did not).
    """
    meta = _read_json(work / "meta.json")
    versions_data = _read_json(work / "versions.json")
    probe_data = _read_json(work / "probe.json")
    steps = _steps(work)
    packages = versions_data.get("packages", {}) if isinstance(versions_data, dict) else {}
    cupy = next((v["version"] for k, v in packages.items() if k.startswith("cupy")), None)
    cuda = versions_data.get("cuDriverGetVersion", {})
    smi = versions_data.get("nvidia_smi", {})
    report: dict[str, Any] = {
        **meta,
        "finished": None,
        "ok": None,
        "failed_steps": [],
        "skipped_steps": [],
        "versions": {
            "nvidia_driver": smi.get("driver_version"),
            "cuDriverGetVersion": cuda.get("version"),
            "cuda_driver_api": cuda.get("cuda"),
            "python": versions_data.get("python"),
            "asyncfence": versions_data.get("asyncfence"),
            "cupy": cupy,
            # Every distribution of DISTRIBUTIONS, None where it is missing.
            **{name: packages.get(_normalized(name), {}).get("version") for name in DISTRIBUTIONS},
            "too_old": versions_data.get("too_old"),
        },
        "gpus": smi.get("gpus", smi.get("error")),
        "cuda_signal": probe_data.get("cuda_signal"),
        "wake_path": probe_data.get("wake_path"),
        "shim": {
            **_read_json(work / "shim.json"),
            "loaded": probe_data.get("shim_loaded"),
            "unavailable_reason": probe_data.get("shim_unavailable_reason"),
        },
        "probe": probe_data.get("loops", probe_data),
        "pytest": _read_json(work / "pytest.json"),
        "tests": _tests_from_log(out / "tests.jsonl"),
        "junit": _junit(out / "junit.xml"),
        "skip_reasons": _skip_reasons(out / "tests.jsonl"),
        "example": {**steps.get("example", {}), "output": _tail(work / "example.txt", 8)},
        "bench": {
            "full": _bench(out, "bench", steps.get("bench")),
            "quick": _bench(out, "bench-quick", steps.get("bench_quick")),
        },
        "hardware_queues": _hardware_queues(meta),
        "stacks": _stacks(out),
        "steps": steps,
        "versions_detail": versions_data,
    }
    # A full bench that timed out is a failure, even with the quick one beside it.
    failed = [name for name, step in steps.items() if step.get("exit_code", 0) != 0]
    skipped = [name for name, step in steps.items() if "status" in step]
    report["failed_steps"] = failed
    report["skipped_steps"] = skipped
    stopped = work / "stopped.json"
    if stopped.exists():
        report["stopped"] = _read_json(stopped).get("reason")
    report["finished"] = (work / "done").exists()
    report["ok"] = not failed and not skipped and report["finished"]
    _write_json(out / "summary.json", report)
    digest = {
        key: report.get(key)
        for key in (
            "ok",
            "failed_steps",
            "skipped_steps",
            "commit",
            "versions",
            "hardware_queues",
            "cuda_signal",
            "wake_path",
            "shim",
            "pytest",
            "tests",
            "junit",
            "example",
            "bench",
            "stacks",
        )
    }
    print(json.dumps(digest, indent=2))
    return 0 if report["ok"] else 1


def note(work: Path, name: str, pairs: list[str]) -> int:
    """Write ``work/name.json`` from ``KEY=VALUE`` pairs.

    Returns:
        0.
    """
    constants: dict[str, Any] = {"true": True, "false": False, "null": None}
    data: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if value in constants:
            data[key] = constants[value]
        elif value.lstrip("-").isdigit():
            data[key] = int(value)
        else:
            data[key] = value
    _write_json(work / f"{name}.json", data)
    return 0


def main(argv: list[str]) -> int:
    """Run one step; see the module's docstring."""
    if len(argv) >= 3 and argv[0] == "imports":
        return imports(argv[1], Path(argv[2]))
    if len(argv) == 2 and argv[0] == "versions":
        return versions(Path(argv[1]))
    if len(argv) == 2 and argv[0] == "probe":
        return probe(Path(argv[1]))
    if len(argv) >= 3 and argv[0] == "note":
        return note(Path(argv[1]), argv[2], argv[3:])
    if len(argv) == 3 and argv[0] == "summary":
        return summary(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
