#!/usr/bin/env python3
"""Where Lily's layer goes, instruction by instruction.

Reads the four profiles `lily-bench cost --only instructions` leaves in a directory when
`LILY_BENCH_CALLGRIND_DIR` names it, or the regression gate's with `lily-regress
--callgrind-dir DIR` (raw and Lily, a long and a short run each), and prints each
part of the program's instructions a message, raw against Lily, largest difference first: the
short run is subtracted from the long one, so the start and the close cancel out.

    LILY_BENCH_CALLGRIND_DIR=/tmp/cg scripts/bench.sh cost --quick --only instructions
    bench/tools/callgrind_layers.py /tmp/cg
    scripts/regress.sh --rounds 1 --callgrind-dir /tmp/gate; bench/tools/callgrind_layers.py /tmp/gate

Each function's own instructions (not those of what it calls) count once, in the first part
whose pattern matches its name.
"""

import collections
import pathlib
import re
import subprocess
import sys

PARTS = [
    ("delivery pipeline (rabbit::delivery)", r"lily_mq_rabbit::delivery"),
    ("frame reader (rabbit::wire)", r"lily_mq_rabbit::wire"),
    ("consume loop, inline gate, crew", r"lily_mq_rabbit::(consume|consumer|channel)"),
    ("other rabbit", r"lily_mq_rabbit::"),
    ("envelope and header checks (core)", r"lily_mq_core::(envelope|seal)"),
    ("machine, decision, ledger, pacer (core)", r"lily_mq_core::(machine|decision|ledger|pace|budget)"),
    ("router, handler, codec (core)", r"lily_mq_core::(router|handler|codec|extract)"),
    ("other core", r"lily_mq_core::"),
    ("tracing", r"tracing"),
    ("clock reads", r"Timespec|clock_gettime"),
    ("memcpy, memset, memmove", r"^__mem(cpy|set|move)|^mem(cpy|set|move)"),
    ("allocator", r"^(malloc|free|_int_free|_int_malloc|realloc|_int_realloc|malloc_consolidate|unlink_chunk|calloc|cfree)\b"),
    ("frame parsing (nom, amq-protocol)", r"nom::|amq_protocol"),
    ("lapin", r"lapin::"),
    ("tokio", r"tokio::"),
    ("serde", r"serde"),
    ("futures, event-listener", r"futures|event_listener|core::future"),
    ("the benchmark's own code", r"lily_mq_bench|lily_mq_regress"),
]
LINE = re.compile(r"\s*([\d,]+) \([ \d.]+%\)\s+(.*)$")


def functions(profile):
    """Each function's own instructions in `profile`."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--auto=no", "--threshold=100", str(profile)],
        capture_output=True, text=True, check=True,
    ).stdout
    own = collections.Counter()
    for line in text.splitlines():
        match = LINE.match(line)
        if not match or "PROGRAM TOTALS" in line:
            continue
        name = match.group(2).rsplit(" [", 1)[0]
        name = name.split(":", 1)[1] if ":" in name else name
        name = re.sub(r"'\d+$", "", re.sub(r" \([\d,]+x\)$", "", name))
        own[name] += int(match.group(1).replace(",", ""))
    return own


def part(name):
    return next((p for p, pattern in PARTS if re.search(pattern, name)), "other")


def main(directory):
    runs = {}
    for profile in pathlib.Path(directory).glob("callgrind.*[0-9]"):
        command = next(l for l in profile.open() if l.startswith("cmd:")).split()
        verb = next((v for v in ("run", "consume") if v in command), None)
        if verb:
            who, n = command[command.index(verb) + 1 : command.index(verb) + 3]
            runs[(who, int(n))] = functions(profile)
    per_message = {}
    for who in ("raw", "lily"):
        (big, n), (small, n0) = sorted(((runs[k], k[1]) for k in runs if k[0] == who), key=lambda r: -r[1])
        parts = collections.Counter()
        for name in big.keys() | small.keys():
            parts[part(name)] += (big[name] - small[name]) / (n - n0)
        per_message[who] = parts
    raw, lily = per_message["raw"], per_message["lily"]
    print(f"{'part':44} {'raw':>8} {'Lily':>8} {'Lily - raw':>11}")
    for name in sorted(raw.keys() | lily.keys(), key=lambda p: -(lily[p] - raw[p])):
        print(f"{name:44} {raw[name]:8.0f} {lily[name]:8.0f} {lily[name] - raw[name]:+11.0f}")
    print(f"{'total':44} {sum(raw.values()):8.0f} {sum(lily.values()):8.0f} {sum(lily.values()) - sum(raw.values()):+11.0f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
