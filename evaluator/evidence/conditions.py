"""Operating conditions of a campaign: power source and policy, sleep, thermal state, background load.

Measured where Linux exposes them (read before and after the runs):
- power source: /sys/class/power_supply/*/{type,online,status} (mains online, battery charging or not);
- power policy: cpufreq scaling_governor of every CPU, /sys/firmware/acpi/platform_profile;
- sleep: /sys/power/suspend_stats/success (a change means the machine suspended mid-campaign);
- thermal: /sys/class/thermal/thermal_zone*/{type,temp}, the CPUs' thermal_throttle counters,
  and, with an NVIDIA driver, nvidia-smi's GPU temperature, power draw and active throttle reasons;
- background load: the 1-minute load average before the runs, per usable core.
What is absent reads "not measured"; the operator can state power source/policy with --power.
`root` is the filesystem root the /sys and /proc paths are read under (tests pass a fake tree).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

NOT_MEASURED = "not measured"
QUIET_LOAD_PER_CORE = 0.25  # 1-minute load average per usable core below which the machine counts as quiet


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def power_supplies(root: Path = Path("/")) -> list[dict]:
    """One record per power supply: name, type (Mains, Battery, USB, ...), online, status."""
    out = []
    base = root / "sys/class/power_supply"
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        out.append({"name": d.name, "type": _read(d / "type"), "online": _read(d / "online"),
                    "status": _read(d / "status")})
    return out


def power_source(supplies: list[dict]) -> str:
    """'mains', 'battery (Discharging)', ... from the supplies, or 'not measured'."""
    if not supplies:
        return NOT_MEASURED
    batteries = [s for s in supplies if s["type"] == "Battery"]
    if any(s["type"] == "Mains" and s["online"] == "1" for s in supplies):
        return "mains" + (f" (battery {batteries[0]['status']})" if batteries and batteries[0]["status"] else "")
    if batteries:
        return f"battery ({batteries[0]['status'] or 'status unknown'})"
    return NOT_MEASURED


def power_policy(root: Path = Path("/")) -> dict:
    """The cpufreq governors in use (governor -> CPU count) and the ACPI platform profile."""
    governors: dict[str, int] = {}
    for gov in sorted((root / "sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_governor")):
        name = _read(gov)
        if name:
            governors[name] = governors.get(name, 0) + 1
    profile = _read(root / "sys/firmware/acpi/platform_profile")
    return {"cpufreq_governors": governors or NOT_MEASURED, "platform_profile": profile or NOT_MEASURED}


def suspend_count(root: Path = Path("/")) -> int | None:
    """Successful suspends since boot, or None where Linux does not say."""
    text = _read(root / "sys/power/suspend_stats/success")
    return int(text) if text and text.isdigit() else None


def thermal_zones(root: Path = Path("/")) -> list[dict]:
    """Every thermal zone's type and temperature in degrees C."""
    out = []
    for d in sorted((root / "sys/class/thermal").glob("thermal_zone*")):
        temp = _read(d / "temp")
        out.append({"zone": d.name, "type": _read(d / "type"),
                    "celsius": int(temp) / 1000 if temp and temp.lstrip("-").isdigit() else None})
    return out


def throttle_events(root: Path = Path("/")) -> int | None:
    """Sum of the CPUs' thermal throttle counters (x86), or None where there are none."""
    total, seen = 0, False
    for f in (root / "sys/devices/system/cpu").glob("cpu[0-9]*/thermal_throttle/*_throttle_count"):
        text = _read(f)
        if text and text.isdigit():
            total, seen = total + int(text), True
    return total if seen else None


def gpu_state() -> list[dict] | None:
    """GPU temperature, power draw and active throttle reasons from nvidia-smi, or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = "temperature.gpu,power.draw,power.limit,clocks_throttle_reasons.active"
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    gpus = []
    for line in proc.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            gpus.append(dict(zip(("temperature_c", "power_draw_w", "power_limit_w", "throttle_reasons"), parts)))
    return gpus or None


def loadavg(root: Path = Path("/")) -> list[float] | None:
    """1, 5 and 15-minute load averages, or None."""
    text = _read(root / "proc/loadavg")
    try:
        return [float(x) for x in text.split()[:3]] if text else None
    except ValueError:
        return None


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def snapshot(root: Path = Path("/"), gpu: bool = True) -> dict:
    """Everything measured at one moment (taken before and after the runs)."""
    supplies = power_supplies(root)
    return {"power_supplies": supplies, "power_source": power_source(supplies), "power_policy": power_policy(root),
            "suspend_count": suspend_count(root), "thermal_zones": thermal_zones(root),
            "throttle_events": throttle_events(root), "gpu": gpu_state() if gpu else None,
            "loadavg": loadavg(root), "usable_cores": usable_cores()}


def judge(before: dict, after: dict | None, operator_power: str | None) -> dict:
    """The disclosure's conditions block: power, sleep, thermal and background load, each measured
    or 'not measured', with what changed during the campaign. `blocking` lists what forbids promotion."""
    after = after or {}
    blocking = []
    s0, s1 = before.get("suspend_count"), after.get("suspend_count")
    if s0 is None or s1 is None:
        sleep = NOT_MEASURED
    elif s1 != s0:
        sleep = f"the machine suspended {s1 - s0} time(s) during the campaign"
        blocking.append(f"sleep: {sleep}")
    else:
        sleep = "no suspend during the campaign (suspend_stats unchanged)"
    t0, t1 = before.get("throttle_events"), after.get("throttle_events")
    throttle = NOT_MEASURED if t0 is None or t1 is None else (
        f"{t1 - t0} CPU thermal throttle event(s) during the campaign")
    load, cores = before.get("loadavg"), before.get("usable_cores") or 1
    if load is None:
        background = {"judgement": NOT_MEASURED}
    else:
        per_core = load[0] / cores
        quiet = per_core < QUIET_LOAD_PER_CORE
        background = {"loadavg_1m": load[0], "usable_cores": cores, "per_core": round(per_core, 3),
                      "judgement": (f"quiet (1-minute load {load[0]:g} on {cores} cores < {QUIET_LOAD_PER_CORE} "
                                    "per core)") if quiet else
                                   (f"busy (1-minute load {load[0]:g} on {cores} cores >= {QUIET_LOAD_PER_CORE} "
                                    "per core): other work shared the machine")}
    policy = before.get("power_policy") or {}
    return {
        "power": {"source": before.get("power_source", NOT_MEASURED),
                  "policy": policy or NOT_MEASURED,
                  "operator": operator_power or "not stated (set --power)",
                  "supplies": before.get("power_supplies") or NOT_MEASURED},
        "sleep": sleep,
        "thermal": {"zones_before": before.get("thermal_zones") or NOT_MEASURED,
                    "zones_after": after.get("thermal_zones") or NOT_MEASURED,
                    "cpu_throttling": throttle,
                    "gpu_before": before.get("gpu") or NOT_MEASURED, "gpu_after": after.get("gpu") or NOT_MEASURED},
        "background_load": background | {"loadavg_before": load, "loadavg_after": after.get("loadavg")},
        "blocking": blocking,
    }
