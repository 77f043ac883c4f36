"""Kernel-log parsing time (Xids and host signals) on a ring buffer of ordinary records.

The input is ``/dev/kmsg``-format records like a GPU node's, of the size the prolog
reads (``--kib``, default 256 KiB: Ubuntu's log_buf_len; 4096 is the read limit),
with a few Xid and host-signal records among them. Reference in the same run: the
least any Xid parser must do, one ``"Xid" in line`` test per line. Run::

    .venv/bin/python benchmarks/bench_kernlog.py [--kib 256] [--repeat 20]
"""

from __future__ import annotations

import argparse
import time

from timing import repeat

from slurm_resilience.fakes import kmsg
from slurm_resilience.health.collectors import xid

_ORDINARY = (
    "mlx5_core 0000:{b:02x}:00.0: mlx5_fw_tracer_handle_traces:{n}: FW trace event",
    "audit: type=1400 audit({n}.120:{b}): apparmor=\"STATUS\" operation=\"profile_load\"",
    "IPv6: ADDRCONF(NETDEV_CHANGE): ib{b}: link becomes ready",
    "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, skipping",
)


def records(kib: int) -> list[str]:
    lines: list[str] = []
    size = 0
    n = 0
    while size < kib << 10:
        n += 1
        if n % 1000 == 0:
            msg = kmsg.xid_message("0000:5d:00", 13)
        elif n % 1501 == 0:
            msg = kmsg.HOST_SIGNAL_LINES["soft-lockup"]
        else:
            msg = _ORDINARY[n % len(_ORDINARY)].format(n=n, b=n % 256)
        line = f"6,{n},{n * 1000},-;{msg}"
        lines.append(line)
        size += len(line) + 1
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=256, help="size of the log in KiB")
    parser.add_argument("--repeat", type=int, default=20, help="measured runs of each")
    args = parser.parse_args()
    lines = records(args.kib)
    now = time.time()
    ref = repeat(lambda: [ln for ln in lines if "Xid" in ln], args.repeat)
    got = repeat(lambda: xid.parse_lines(lines, "b", now - 86400, now), args.repeat)
    parsed = xid.parse_lines(lines, "b", now - 86400, now)
    print(f"{len(lines)} records, {args.kib} KiB: {len(parsed.events)} Xids, "
          f"{len(parsed.host_events)} host signals")
    print(f"reference ('Xid' in line)  {ref.ms()}")
    print(f"parse_lines                {got.ms()}  {got.p50 / ref.p50:.1f}x reference")


if __name__ == "__main__":
    main()
