"""sbatch throughput with job_submit.lua (leaf pinning) against the same sandbox without it.

Goal (issue 5): with the plugin, at least 0.95x the submissions per second of
the plugin-less sandbox. Two sandboxes (6 nodes, 3 leaves) run side by side,
one with JobSubmitPlugins=lua and the generated data, one without; rounds
alternate submission by submission so machine noise hits both; the ratio is
of median per-submission latencies. Jobs are 2-node and submitted held
(--hold), so only submission is measured, then cancelled. Also reported: the
plugin's own cost per call in Lua 5.1 with 512-leaf data. Run as root::

    .venv/bin/python benchmarks/bench_submit_overhead.py [--jobs 300] [--lua-calls 100000]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from timing import summarise

from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.sandbox.layout import S3_OFFSET, Layout

REPO = Path(__file__).resolve().parents[1]


def _free(base: int, nodes: int) -> bool:
    for port in [base, *range(base + 1, base + nodes + 1), base + S3_OFFSET]:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def start(name: str, base: int, overrides: dict[str, str]) -> Sandbox:
    while not _free(base, 6):
        base += 150
    state = Path(tempfile.mkdtemp(prefix=f"sr-bench-{name}-", dir="/tmp"))
    state.chmod(0o755)
    layout = Layout(state_dir=state, nodes=6, leaves=3, port_base=base, repo=REPO,
                    slurm_overrides=tuple(overrides.items()))
    return Sandbox.start(layout)


def submit_seconds(box: Sandbox) -> float:
    """Wall time of one held 2-node sbatch (process start, RPC, job_submit, reply)."""
    start = time.perf_counter()
    box.sbatch(["true"], args=["-N2", "--hold", "--output=/dev/null"])
    return time.perf_counter() - start


def lua_cost_us(calls: int) -> tuple[float, float]:
    """Microseconds per slurm_job_submit call in Lua 5.1 (lupa) with 512-leaf data, and per
    call of an empty Lua function: the plugin's own cost, free of sbatch and machine noise."""
    import lupa.lua51 as lupa

    from slurm_resilience.config.topology import TopologySection
    from slurm_resilience.topology import generate, model

    leaves = tuple(model.Leaf(f"leaf{i:04d}", tuple(f"n{i}-{j}" for j in range(32)),
                              (f"leaf{i:04d}",)) for i in range(512))
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(REPO / "hooks" / "job_submit.lua", tmp)
        Path(tmp, generate.DATA_FILE).write_text(
            generate.lua_data(model.Fabric(leaves), TopologySection()))
        lua = lupa.LuaRuntime()
        lua.execute("slurm = { SUCCESS = 0, log_info = function() end, "
                    "log_error = function() end }")
        lua.execute(f"dofile({str(Path(tmp, 'job_submit.lua'))!r})")
        bench = lua.eval("""function(n, fn)
            local t0 = os.clock()
            for i = 1, n do
                local job = { min_nodes = 1 + i % 40, req_switch = 4294967294,
                              name = "bench", partition = "batch" }
                fn(job, {}, 1000)
            end
            return (os.clock() - t0) / n * 1e6
        end""")
        ours = bench(calls, lua.globals().slurm_job_submit)
        empty = bench(calls, lua.eval("function(job, parts, uid) return 0 end"))
    return ours, empty


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300, help="submissions per sandbox")
    parser.add_argument("--lua-calls", type=int, default=100_000)
    parser.add_argument("--port-base", type=int, default=26000)
    args = parser.parse_args()
    with_lua = start("lua", args.port_base, {})
    without = start("plain", args.port_base + 300, {"JobSubmitPlugins": ""})
    try:
        log = (with_lua.layout.log_dir / "slurmctld.log").read_text(errors="replace")
        if "leaf-pin: loaded" not in log:
            print("the plugin did not load its data; see slurmctld.log", file=sys.stderr)
            return 1
        boxes = {"lua": with_lua, "plain": without}
        for box in boxes.values():
            for _ in range(5):
                submit_seconds(box)
        samples: dict[str, list[float]] = {"lua": [], "plain": []}
        for i in range(args.jobs):
            # Interleaved one by one, order alternating, so load bursts hit both alike.
            order = ["lua", "plain"] if i % 2 == 0 else ["plain", "lua"]
            for name in order:
                samples[name].append(submit_seconds(boxes[name]))
        for box in boxes.values():
            box.run(["scancel", "--state=PENDING", "--full"], check=False)
        pinned = (with_lua.layout.log_dir / "slurmctld.log").read_text().count("switches=")
        lua, plain = summarise(samples["lua"]), summarise(samples["plain"])
        print(f"with job_submit.lua: {lua.ms()}; {pinned} submissions pinned")
        print(f"without plugin:      {plain.ms()}")
        ratio = plain.p50 / lua.p50
        print(f"sbatch throughput ratio (median latency, plain/lua): {ratio:.3f}x "
              f"(goal >= 0.95x: {'met' if ratio >= 0.95 else 'NOT met'})")
        ours, empty = lua_cost_us(args.lua_calls)
        print(f"slurm_job_submit in Lua 5.1, 512 leaves: {ours:.2f} us per call (empty Lua "
              f"function: {empty:.2f} us); that is {ours / (lua.p50 * 1e6):.5f} of one "
              "sbatch submission")
        return 0
    finally:
        for box in (with_lua, without):
            box.stop()
            shutil.rmtree(box.state_dir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
