#!/usr/bin/env python3
"""Where the broker's CPU goes a message, contender by contender, off `perf` recordings.

`throughput` records the broker while each contender runs when asked to (see
`Profile` in `bench/src/throughput/mod.rs`):

    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="+JPperf true" scripts/rabbitmq.sh start /tmp/lrb 25692
    LILY_BENCH_PERF_BROKER=/tmp/prof LILY_RABBIT_DIR=/tmp/lrb \\
        LILY_AMQP_URL=amqp://guest:guest@127.0.0.1:25692/%2f \\
        target/release/lily-bench throughput --paths success --contenders raw-batch,ceiling,lily ...
    python3 bench/tools/broker_time.py MESSAGES /tmp/prof/*.data

or, for recordings of the broker's `fsync` calls (`LILY_BENCH_PERF_EVENTS=syscalls:sys_enter_fsync,
syscalls:sys_exit_fsync`, as `latency` makes them round by round):

    python3 bench/tools/broker_time.py syncs /tmp/prof/*.data

`+JPperf true` makes the Erlang VM write a map of its JIT-compiled code and keep frame
pointers, so `perf` names the Erlang functions. The VM's own C code is stripped in Debian's
package (no debug symbols are published for it where this machine can fetch them), so the
time spent there (garbage collection, copying messages between processes, built-in functions)
is counted as one part when no Erlang frame is on its stack, and not split further.

It prints a table of the broker's CPU microseconds a message (every sample of every thread,
divided by MESSAGES; perf's cpu-clock period is in nanoseconds), one column for each case and
contender, the recordings of one averaged, split by where each sample was taken: the kernel by
what it was doing (files, socket I/O, waking and sleeping), Erlang code by the broker process
that ran it (the queue, the channel, the connection's reader and writer), and the VM's C code.
A last row counts the samples taken inside the handling of an ACK, in any process. With
`--folded DIR` it also writes each recording's stacks folded, one line a stack, for a flame
graph tool. Needs `perf` on the PATH; reads no message contents.
"""

import collections
import os
import re
import subprocess
import sys

# The broker's processes, by the module whose loop runs them (the outermost frame that names one).
PROCESSES = [
    ("classic queue process", re.compile(r"^rabbit_amqqueue_process$")),
    ("quorum queue (ra server, its log)", re.compile(r"^(ra_server_proc|ra_log\w*)$")),
    ("message store", re.compile(r"^rabbit_msg_store\w*$")),
    ("channel", re.compile(r"^rabbit_channel$")),
    ("connection reader", re.compile(r"^rabbit_reader$")),
    ("connection writer", re.compile(r"^rabbit_writer$")),
]

# Functions that handle a settlement, by name (`ack`, `subtract_acks`, `remove_pending_ack`,
# `settle`, `complete`...): a stack through one of them also counts as settling work.
SETTLING = re.compile(
    r"^\$rabbit\w*:'?-?(?:\w*_)?(?:acks?|settle\w*|complete|acknowledged)(?:[_/'-]|$)"
)

KERNEL = [
    ("kernel: waking and sleeping (scheduler, epoll, futex)", re.compile(r"schedule|epoll|futex|nanosleep|poll_schedule")),
    ("kernel: socket I/O", re.compile(r"tcp_|sock_|inet_|skb|__sys_sendto|__sys_recvfrom")),
    ("kernel: files (writes, syncs)", re.compile(r"ext4_|xfs_|btrfs_|generic_perform_write|filemap_|fsync|iomap_|jbd2|blk_|ovl_")),
]


def perf_script(path, fields):
    """`perf script` of the recording `path`, with `fields`."""
    return subprocess.run(
        ["perf", "script", "-i", path, "-F", fields],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def stacks(path):
    """Yields (weight, frames leaf first) for every sample of `path`."""
    out = perf_script(path, "period,ip,sym,dso")
    weight, frames = None, []
    for line in out.splitlines() + [""]:
        line = line.strip()
        if not line:
            if weight is not None:
                yield weight, frames
            weight, frames = None, []
        elif weight is None:
            weight = int(line.split()[0])
        else:
            parts = line.split(None, 1)
            frames.append(parts[1] if len(parts) > 1 else parts[0])


def module(frame):
    """The Erlang module a JIT frame belongs to (`$mod:fun/arity`), or None."""
    match = re.match(r"^\$([a-z_0-9]+):", frame)
    return match.group(1) if match else None


def part(frames):
    """Where a sample (frames leaf first) was taken: the kernel by what it did, else the broker
    process that ran, else the VM's C code (no Erlang frame on the stack)."""
    leaf = frames[0] if frames else ""
    if "[kernel.kallsyms]" in leaf:
        text = " ".join(frames)
        for name, pattern in KERNEL:
            if pattern.search(text):
                return name
        return "kernel: other"
    modules = [m for m in map(module, frames) if m]
    for mod in reversed(modules):
        for name, pattern in PROCESSES:
            if pattern.match(mod):
                return name
    if modules:
        return "other Erlang processes"
    return "the VM's C code (no Erlang frame on the stack)"


def settling(frames):
    """Whether the sample was taken inside the handling of a settlement (an ACK)."""
    return any(SETTLING.match(f) for f in frames)


def case_of(path):
    """`broker-success-classic-50-lily-7.data` -> `success-classic-50-lily`."""
    name = os.path.basename(path)
    return re.sub(r"^broker-|-\d+\.data$", "", name)


def syncs(paths):
    """For each recording of `fsync` calls: per file synced (named by the `.fds` kept beside
    the recording), how many syncs, how long they took, and the gaps of 20 ms or more between
    one sync of the file and the next."""
    for path in paths:
        files = {}
        with open(path + ".fds", encoding="utf-8") as f:
            for line in f:
                fd, _, target = line.strip().partition(" ")
                files[fd] = re.sub(r".*/msg_stores/vhosts/[^/]+/", "", target)
        out = perf_script(path, "tid,time,event,trace")
        entered, calls = {}, collections.defaultdict(list)
        for line in out.splitlines():
            match = re.match(r"\s*(\d+)\s+([\d.]+):\s+syscalls:sys_(enter|exit)_f\w*sync:\s*(.*)", line)
            if not match:
                continue
            tid, at, kind, rest = match.groups()
            if kind == "enter":
                fd = re.search(r"fd: (0x[0-9a-f]+|\d+)", rest).group(1)
                entered[tid] = (float(at), str(int(fd, 0)))
            elif tid in entered:
                began, fd = entered.pop(tid)
                calls[fd].append((began, float(at) - began))
        print(f"{os.path.basename(path)}:")
        for fd, made in sorted(calls.items(), key=lambda kv: -len(kv[1]))[:3]:
            took = sorted(t for _, t in made)
            starts = sorted(b for b, _ in made)
            gaps = [b - a for a, b in zip(starts, starts[1:]) if b - a >= 0.02]
            print(
                f"  {files.get(fd, 'fd ' + fd)}: {len(made)} syncs, p50 {took[len(took) // 2] * 1e3:.2f} ms, "
                f"p99 {took[int(len(took) * 0.99)] * 1e3:.2f} ms; {len(gaps)} gaps of 20 ms or more, "
                f"{sum(gaps) * 1e3:.0f} ms in all, the longest {max(gaps, default=0) * 1e3:.0f} ms"
            )


def main():
    args = sys.argv[1:]
    if args[:1] == ["syncs"]:
        syncs(args[1:])
        return
    folded = None
    if "--folded" in args:
        at = args.index("--folded")
        folded = args[at + 1]
        del args[at : at + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    messages = int(args[0])
    parts = collections.defaultdict(collections.Counter)
    runs = collections.Counter()
    for path in args[1:]:
        case = case_of(path)
        runs[case] += 1
        fold = collections.Counter()
        for weight, frames in stacks(path):
            parts[case][part(frames)] += weight
            if settling(frames):
                parts[case]["(of the above: handling ACKs, any process)"] += weight
            if folded:
                fold[";".join(reversed(frames))] += weight
        if folded:
            os.makedirs(folded, exist_ok=True)
            target = os.path.join(folded, os.path.basename(path).replace(".data", ".folded"))
            with open(target, "w") as f:
                for stack, weight in fold.items():
                    f.write(f"{stack.replace(' ', '_')} {weight}\n")
    names = sorted({p for counter in parts.values() for p in counter})
    cases = sorted(parts)
    # perf's cpu-clock period is in nanoseconds.
    per = {c: {p: parts[c][p] / runs[c] / messages / 1e3 for p in names} for c in cases}
    print("| where (µs a message) | " + " | ".join(cases) + " |")
    print("|---|" + "---:|" * len(cases))
    for p in sorted(names, key=lambda p: (p.startswith("("), -max(per[c][p] for c in cases))):
        print(f"| {p} | " + " | ".join(f"{per[c][p]:.1f}" for c in cases) + " |")
    total = {c: sum(v for p, v in per[c].items() if not p.startswith("(")) for c in cases}
    print("| **all** | " + " | ".join(f"**{total[c]:.1f}**" for c in cases) + " |")
    counts = sorted(set(runs.values()))
    each = str(counts[0]) if len(counts) == 1 else "/".join(str(runs[c]) for c in cases)
    print(f"\nRecordings a column: {each}, of {messages} messages each.")


if __name__ == "__main__":
    main()
