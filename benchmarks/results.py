"""Write benchmarks/RESULTS.md from the JSON the benchmarks wrote (on any machine, no GPU needed).

    python benchmarks/results.py benchmarks/results/*.json

Each file becomes one section headed by where and when it ran (device, ranks, date, torch and
triton versions, and the machine and command where the file records them), newest first. EP all-to-all files (bench_all_to_all.py) get their latency table, the NCCL
baselines, DeepEP's columns, the put path (--puts), the payload formats (--formats), the eager crossover
(--crossover) and the per-phase breakdown; any other file gets a table
of the scalar columns of each list of rows it holds ('-' where a row has no such entry).
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_all_to_all import crossover_line, deepep_tables, put_and_format_tables  # noqa: E402
from moe_ep.timing import markdown_table  # noqa: E402

EP_COLUMNS = ["tokens", "max_tokens", "dispatch_graph_us", "dispatch_floor_us", "dispatch_link_floor_us",
              "dispatch_copy_floor_us", "dispatch_x_floor", "dispatch_eager_us", "dispatch_host_us", "nccl_dispatch_us",
              "reference_dispatch_us", "combine_graph_us", "combine_floor_us", "combine_link_floor_us",
              "combine_copy_floor_us", "combine_x_floor", "combine_eager_us", "combine_host_us", "nccl_combine_us",
              "reference_combine_us", "dispatch_link_GBps", "combine_link_GBps"]
PHASES = ("send", "signal", "wait", "recv")


def header(data: dict, path: Path) -> str:
    where = f"{data.get('world', '?')}x {data.get('device', '?')}"
    text = (f"### {path.stem}: {where}\n\n{data.get('date', '?')}, torch {data.get('torch', '?')}, "
            f"triton {data.get('triton', '?')}\n")
    if "machine" in data:
        text += f"\nMachine: {data['machine']}.\n"
    if "command" in data:
        text += f"\nCommand: `{data['command']}`\n"
    return text


def ep_section(data: dict) -> str:
    rows = sorted(data["settings"], key=lambda r: r["tokens"])
    for row in rows:
        for op in ("dispatch", "combine"):
            row[f"{op}_link_GBps"] = row[f"{op}_link_MB"] * 1e3 / row[f"{op}_graph_us"]
    text = ("\nMicroseconds per call, rank 0 (graph: a CUDA graph of 10 calls replayed after a barrier, per call; "
            "eager: one call after a barrier; host: CPU time of a call while the GPU is busy; nccl: "
            "all_to_all_single with one host sync; reference: the test oracle; floor: the bytes the op must move "
            "through HBM at the datasheet peak; link floor: the bytes it must move over the links, the larger "
            "direction, at NVLink's datasheet peak (450 GB/s a direction), copy floor: the same at the copy "
            "engines' rate measured in the run; x_floor: graph over the larger of the HBM and link floors). Link "
            "GB/s: the link bytes over the graph time.\n\n" + markdown_table(rows, EP_COLUMNS) + "\n")
    if data.get("peer_copy_GBps"):
        text += (f"\nCopy engines, every rank to every other at once: {data['peer_copy_GBps']:.0f} GB/s leave each "
                 "GPU.\n")
    if "deepep" in data:
        text += f"\n{data['deepep']}.\n"
    text += deepep_tables(rows) + put_and_format_tables(rows, data.get("formats"))
    if "crossover" in data:
        text += f"\n{crossover_line(data['crossover'])}.\n"
    lines = []
    for row in rows:
        for rank, phases in enumerate(row.get("breakdown") or []):
            parts = [f"{op}: " + " + ".join(f"{p} {phases[f'{op}_{p}_us']:.1f}" for p in PHASES)
                     + f" = {phases[f'{op}_total_us']:.1f} us" for op in ("dispatch", "combine")]
            lines.append(f"    {row['tokens']} tokens, rank {rank}: " + "; ".join(parts))
    if lines:
        text += ("\nBreakdown of eager calls after a barrier, device timestamps, medians (wait includes the "
                 "other rank's lag behind this one):\n\n" + "\n".join(lines) + "\n")
    return text


def generic_section(data: dict) -> str:
    text = ""
    for key, value in data.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = list(dict.fromkeys(c for v in value for c in v))
            columns = [c for c in columns if all(isinstance(v.get(c), (int, float, str, type(None))) for v in value)]
            text += f"\n{key}:\n\n{markdown_table(value, columns, '.4g')}\n"
    return text


def main(paths: list[str]) -> None:
    if not paths or paths[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    runs = []
    for path in map(Path, paths):
        data = json.loads(path.read_text())
        is_ep = "settings" in data and data["settings"] and "dispatch_graph_us" in data["settings"][0]
        runs.append((data.get("date", ""), header(data, path) + (ep_section(data) if is_ep else generic_section(data))))
    out = Path(__file__).with_name("RESULTS.md")
    out.write_text("# Measured results\n\nWritten by `python benchmarks/results.py` from the JSON in "
                   "`benchmarks/results/`; each section says where and when it ran, newest first: the first "
                   "section of a benchmark on a machine is its current result, the later ones are history (the "
                   "before and after of a change).\n\n"
                   + "\n".join(text for _, text in sorted(runs, key=lambda run: run[0], reverse=True)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
