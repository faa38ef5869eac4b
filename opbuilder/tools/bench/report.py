"""Showing the numbers: the console table, RESULTS.md, the JSON file and the bar chart. Nothing here
measures; every figure comes from the run's rows."""

from __future__ import annotations

import json
from pathlib import Path

from opbuilder.tools.bench.host import table as _host_rows_table
from opbuilder.tools.bench.specs import SPECS

COLUMNS = ("op", "shape", "dtype", "pass", "impl", "time (us)", "GB/s", "TFLOP/s", "of copy", "vs eager", "vs compile", "note")


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _rate(value: float | None) -> str:
    """GB/s or TFLOP/s with three significant digits where they are small (CPU numbers)."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _time(us: float | None) -> str:
    return "-" if us is None else (f"{us:,.1f}" if us < 1000 else f"{us:,.0f}")


def _note(row: dict) -> str:
    notes = []
    if row.get("error"):
        notes.append(f"ERROR {row['error']}")
    check = row.get("check")
    if check == "fail":
        detail = row.get("check_note") or f"rel err {row['rel_err']:.2e} > {row['tolerance']:.0e}"
        notes.append(f"MISMATCH vs eager: {detail}")
    elif check == "error":
        notes.append(f"check failed to run: {row.get('check_note')}")
    return "; ".join(notes)


def columns(rows: list[dict]) -> tuple[str, ...]:
    """COLUMNS, with "vs liger" after "vs compile" when Liger-Kernel ran in this run."""
    if not any(r["impl"] == "liger" for r in rows):
        return COLUMNS
    at = COLUMNS.index("vs compile") + 1
    return COLUMNS[:at] + ("vs liger",) + COLUMNS[at:]


def cells(row: dict, with_liger: bool = False) -> list[str]:
    line = [
        row["op"], "x".join(map(str, row["shape"])), row["dtype"], row["pass"], row["impl"], _time(row.get("us")),
        _rate(row.get("GBps")), _rate(row.get("TFLOPs")), _num(row.get("frac_copy"), 2),
        _num(row.get("vs_eager"), 2), _num(row.get("vs_compile"), 2), _note(row),
    ]
    if with_liger:
        line.insert(COLUMNS.index("vs compile") + 1, _num(row.get("vs_liger"), 2))
    return line


def one_line(rows: list[dict]) -> str:
    """A case's progress line: our time and speedups, or what went wrong."""
    ours = next((r for r in rows if r["impl"] == "ours"), None)
    if ours is None or not ours.get("us"):
        return f"-> {ours.get('error') if ours else 'no result'}"
    text = f"-> ours {_time(ours['us'])} us, vs eager {_num(ours.get('vs_eager'), 2)}, vs compile {_num(ours.get('vs_compile'), 2)}"
    if ours.get("vs_liger"):
        text += f", vs liger {_num(ours['vs_liger'], 2)}"
    if ours.get("frac_copy"):
        text += f", {ours['frac_copy']:.2f} of copy"
    note = _note(ours)
    return text + (f" [{note}]" if note else "")


def table(rows: list[dict]) -> str:
    names = columns(rows)
    with_liger = len(names) > len(COLUMNS)
    body = [list(names)] + [cells(r, with_liger) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(names))]
    right = set(range(5, len(names) - 1))
    out = []
    previous_case = None
    for n, line in enumerate(body):
        case = tuple(line[:4])
        if n > 1 and case != previous_case:
            out.append("")
        previous_case = case
        out.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def copy_note(rows: list[dict], copy_GBps: float) -> str:
    """Why a row's 'of copy' is above 1, when one is: the two copy figures measure different things."""
    above = [r for r in rows if (r.get("frac_copy") or 0) > 1]
    if not above:
        return ""
    return (f"'of copy' is a row's GB/s over the big copy's {_rate(copy_GBps)} GB/s, a ratio: above 1 in {len(above)} "
            "row(s). That copy is too big for any cache, so its writes go to memory; a case this small gets its output "
            "from the allocator in the same, still cached, buffer call after call, and moves its bytes faster. The "
            "'copy, same bytes' row copies the case's bytes the same way (rotated sources, one destination): it is the "
            "yardstick at this size (ours' 'vs copy, same bytes' is in the JSON's 'vs').")


def cost_models(rows: list[dict]) -> list[str]:
    """The byte (or FLOP) model of each op and pass shown."""
    lines, seen = [], set()
    for r in rows:
        key = (r["op"], r["pass"])
        if key in seen or r["op"] not in SPECS:
            continue
        seen.add(key)
        spec = SPECS[r["op"]]
        lines.append(f"{r['op']} {r['pass']}: {spec.cost_model if r['pass'] == 'fwd' else spec.cost_model_backward}")
    return lines


def print_report(result: dict) -> None:
    env, copy = result["env"], result["copy"]
    if env.get("liger"):
        print(f"\nLiger-Kernel: {env['liger']}" if env.get("liger_loaded") else f"\nLiger-Kernel: no rows ({env['liger']})")
    print(f"\n{env['device_name']}; torch {env['torch']}; CUDA {env['cuda'] or '-'}; "
          f"copy bandwidth {_rate(copy['GBps'])} GB/s (one copy of {copy['bytes'] / 2**31:.2f} GiB, bytes read + "
          "written over its time: the 'of copy' denominator)")
    if result["rows"]:
        print()
        print(table(result["rows"]))
        note = copy_note(result["rows"], copy["GBps"])
        if note:
            print(f"\n{note}")
    print("\nCost models (least bytes read + written, or FLOPs):")
    for line in cost_models(result["rows"]):
        print(f"  {line}")
    print("vs X = time of X / time of this row (above 1: this row is faster).")
    if result.get("host"):
        print(f"\nHost time per call ({host_note(result['host'])}):")
        print(host_table(result["host"]))
    print(f"Timing: {result['settings']['timing']} (benchmarks/README.md).")
    for op, why in result["skipped"].items():
        print(f"  {op}: {why}")


def host_note(rows: list[dict]) -> str:
    return ("thread CPU time of one forward call on 16-element inputs, the least of 15 rounds; ratio = ours / the "
            "PyTorch call or unfused sequence; target: relu and softmax <= 2.5, a fused op <= 1; floor: our C++ op "
            "called alone, and with a gradient inside an autograd.Function that saves nothing")


def host_table(rows: list[dict]) -> str:
    good = [r for r in rows if not r.get("error")]
    lines = [_host_rows_table(good)] if good else []
    lines += [f"{r['op']}: ERROR {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines)


# ---- files ------------------------------------------------------------------------------------------


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")


def write_markdown(result: dict, path: Path) -> None:
    env, copy, settings = result["env"], result["copy"], result["settings"]
    lines = [
        "# Benchmark results",
        "",
        f"Written by `{result['command']}` on {env['date']}. Do not edit: regenerate with that command "
        "(`benchmarks/run_bench.sh` on the GPU machine).",
        "",
        f"- Device: {env['device_name']}" + (f" ({env['device_detail']})" if env.get("device_detail") else ""),
        f"- torch {env['torch']}, CUDA {env['cuda'] or '-'}, Python {env['python']}, opbuilder {env['opbuilder']}"
        + (f", Liger-Kernel {env['liger']}" if env.get("liger_loaded") else ""),
        f"- Copy bandwidth measured in this run: **{copy['GBps']:,.0f} GB/s** "
        f"(one copy of {copy['bytes'] / 2**31:.2f} GiB, bytes read + written over its time); \"of copy\" is a row's "
        "GB/s over it, a ratio that exceeds 1 where a case's output stays in the cache (see `copy, same bytes`).",
        f"- Timing: {settings['timing']}",
        "- `vs X` = time of X / time of the row: above 1, the row is faster than X. `ours` is opbuilder; `eager` the "
        "PyTorch reference; `compile` the same function under `torch.compile` (default mode); `liger` Liger-Kernel's "
        "op (opbuilder/tools/bench/liger.py: fused add+RMSNorm, LayerNorm after torch.relu, softmax); other names are "
        "extra eager formulations (forward only); `copy, same bytes` copies as many bytes as the op's model "
        "counts, from rotated sources like the op's inputs: what moving that many bytes takes at that size.",
        "",
    ]
    names = columns(result["rows"])
    with_liger = len(names) > len(COLUMNS)
    header = "| " + " | ".join(names) + " |"
    rule = "|" + "|".join("---" if c in ("op", "shape", "dtype", "pass", "impl", "note") else "---:" for c in names) + "|"
    for mode, title in (("fwd", "Forward"), ("fwd+bwd", "Forward + backward")):
        rows = [r for r in result["rows"] if r["pass"] == mode]
        if not rows:
            continue
        lines += [f"## {title}", "", header, rule]
        for r in rows:
            c = cells(r, with_liger)
            if r["impl"] == "ours":
                c[4:6] = [f"**{c[4]}**", f"**{c[5]}**"]
            lines.append("| " + " | ".join(x.replace("|", "\\|") for x in c) + " |")
        lines.append("")
    if result.get("host"):
        lines += ["## Host time per call", "", host_note(result["host"]) + ".", "", "```", host_table(result["host"]),
                  "```", ""]
    lines += ["## Cost models", ""] + [f"- {line}" for line in cost_models(result["rows"])] + [""]
    if result["skipped"]:
        lines += ["## Not measured", ""] + [f"- {op}: {why}" for op, why in result["skipped"].items()] + [""]
    path.write_text("\n".join(lines))


def write_plot(result: dict, path: Path) -> None:
    """Our speedup over eager and over torch.compile for each case, and the fraction of the copy
    bandwidth each implementation reaches. Needs matplotlib (``pip install opbuilder[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib, which is not installed: pip install 'opbuilder[plot]' (or pip install matplotlib)"
        ) from None

    ours = [r for r in result["rows"] if r["impl"] == "ours" and r.get("us")]
    if not ours:
        raise RuntimeError("--plot: no row of ours was timed, so there is no speedup to draw")
    by_case = {(r["op"], tuple(r["shape"]), r["dtype"], r["pass"], r["impl"]): r for r in result["rows"]}
    labels = [f"{r['op']} {'x'.join(map(str, r['shape']))} {r['dtype']} {r['pass']}" for r in ours]
    ys = list(range(len(ours)))[::-1]  # first case on top
    height = 0.38
    fig, (left, right) = plt.subplots(1, 2, sharey=True, figsize=(13, 1.2 + 0.45 * len(ours)))

    # one colour per baseline in both panels: eager blue, torch.compile orange, ours red
    for offset, key, name, colour in ((height / 2, "vs_eager", "vs eager", "tab:blue"),
                                      (-height / 2, "vs_compile", "vs torch.compile", "tab:orange")):
        values = [r.get(key) or 0.0 for r in ours]
        bars = left.barh([y + offset for y in ys], values, height, label=name, color=colour)
        left.bar_label(bars, labels=[f"{v:.2f}" if v else "-" for v in values], fontsize=7, padding=2)
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_yticks(ys, labels, fontsize=8)
    left.set_xlabel("speedup of ours (time of other / time of ours)")
    left.legend(fontsize=8, loc="lower right")

    impls = (("ours", height * 2 / 3, "tab:red"), ("eager", 0.0, "tab:blue"), ("compile", -height * 2 / 3, "tab:orange"))
    for impl, offset, colour in impls:
        values = [(by_case.get((r["op"], tuple(r["shape"]), r["dtype"], r["pass"], impl)) or {}).get("frac_copy") or 0.0
                  for r in ours]
        right.barh([y + offset for y in ys], values, height * 2 / 3, label=impl, color=colour)
    right.axvline(1.0, color="black", linewidth=0.8)
    right.set_xlabel("fraction of the copy bandwidth (none for the matmul)")
    right.legend(fontsize=8, loc="lower right")

    env = result["env"]
    fig.suptitle(f"opbuilder on {env['device_name']}, torch {env['torch']} ({env['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
