#!/usr/bin/env python3
"""The garbage collections of the broker's queue processes, round by round of `latency`.

A classic queue confirms a published message once it has written it to its index, which it
does between the messages in its mailbox; while its process collects garbage, nothing is
confirmed. This asks the Erlang VM to report every collection longer than 10 ms
(`erlang:system_monitor/2` with `long_gc`), by queue, while the benchmark runs:

    python3 bench/tools/queue_gc.py record /tmp/lrb 90 /tmp/gc.txt &    # the node's data dir
    target/release/lily-bench latency --quick --paths handoff ... 2> /tmp/latency.log
    python3 bench/tools/queue_gc.py report /tmp/gc.txt /tmp/latency.log /tmp/gc.svg

`record` runs `scripts/rabbitmq.sh ctl DIR eval` for SECS seconds (it replaces the node's
system monitor, so use a private node) and writes one line per collection: the VM's
milliseconds since recording began, the collection's milliseconds, the queue process's pid,
`old` if it ran before the recording began (a bucket left by an earlier run) or `new`, and the
queue's name. `report` groups them by the retry bucket's process: `latency` declares
a fresh topology for every round, so each round's bucket is a new process, and the rounds'
order and contenders are read off the benchmark's log. It prints, a round each, how many
collections of the bucket took 10 ms or more, their time in all and the longest, beside the
round's settlement and copy-confirm p99, and draws them on a time line (an SVG). Needs nothing
beyond Python; reads no message contents.
"""

import os
import re
import subprocess
import sys

MONITOR = """
Before = erlang:processes(),
Mon = spawn(fun() ->
    erlang:system_monitor(self(), [{long_gc, 10}]),
    Loop = fun L(Acc) ->
        receive
            {monitor, Pid, long_gc, Info} ->
                Name = case erlang:process_info(Pid, dictionary) of
                    {dictionary, D} -> proplists:get_value(process_name, D);
                    _ -> undefined
                end,
                L([{erlang:monotonic_time(millisecond), proplists:get_value(timeout, Info),
                    Pid, Name} | Acc]);
            {stop, From} -> From ! {events, lists:reverse(Acc)}
        end
    end,
    Loop([])
end),
T0 = erlang:monotonic_time(millisecond),
timer:sleep(__SECS__ * 1000),
Mon ! {stop, self()},
receive
    {events, Ev} ->
        Queue = fun({rabbit_amqqueue_process, {resource, _, queue, Q}}) -> Q;
                   (_) -> <<"-">> end,
        Age = fun(P) -> case lists:member(P, Before) of true -> old; false -> new end end,
        file:write_file("__OUT__", [io_lib:format("~b ~b ~s ~s ~s~n",
            [Ms - T0, T, pid_to_list(P), Age(P), Queue(N)]) || {Ms, T, P, N} <- Ev])
after 5000 -> timeout
end.
"""

ROUND = re.compile(
    r"^\s+(\w+) prefetch (\d+) (\d+)% \((\d+)/s\) round (\d+)/(\d+) (\S+)\s+"
    r"(?:published\s+\d+/s\s+)?settled.*?"
    r"p99 ([\d.]+) .*?copy to confirm: p50 [\d.]+ p99 ([\d.]+)"
)


def record(node_dir, secs, out):
    expr = MONITOR.replace("__SECS__", str(int(secs))).replace("__OUT__", os.path.abspath(out))
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "rabbitmq.sh")
    subprocess.run([script, "ctl", node_dir, "eval", expr], check=True)


def rounds_of(log):
    """(path, prefetch, load %, contender, settlement p99, copy p99) of each round, in order."""
    found = []
    for line in open(log, encoding="utf-8"):
        match = ROUND.match(line)
        if match:
            path, prefetch, load, _, _, _, who, p99, copy = match.groups()
            found.append((path, prefetch, load, who, float(p99), float(copy)))
    return found


def report(events_file, log, svg):
    buckets = []  # one per round, in order of their first collection
    by_pid = {}
    for line in open(events_file, encoding="utf-8"):
        at, took, pid, age, queue = line.split(" ", 4)
        if ".retry." not in queue or age != "new":
            continue
        if pid not in by_pid:
            by_pid[pid] = []
            buckets.append(by_pid[pid])
        by_pid[pid].append((int(at), int(took)))
    rounds = rounds_of(log)
    if len(buckets) != len(rounds):
        print(f"warning: {len(buckets)} buckets collected, {len(rounds)} rounds in the log")
    print("| round | load | contender | bucket's collections ≥ 10 ms | their time, ms | longest, ms | settlement p99, ms | copy-confirm p99, ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for i, (events, spec) in enumerate(zip(buckets, rounds), 1):
        took = [t for _, t in events]
        print(f"| {i} | {spec[2]} % | {spec[3]} | {len(took)} | {sum(took)} | {max(took)} "
              f"| {spec[4]:.2f} | {spec[5]:.2f} |")
    draw(buckets, rounds, svg)


def draw(buckets, rounds, svg):
    """A row a round: each collection a bar as long as it took, from when it began."""
    width, left, row = 1000, 190, 26
    spans = [(events[0][0] - events[0][1], events[-1][0]) for events in buckets if events]
    longest = max((end - start for start, end in spans), default=1)
    scale = (width - left - 20) / longest
    height = 50 + row * len(buckets)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="10" y="18" font-size="14">The retry bucket\'s garbage collections of 10 ms '
        f"or more, round by round (bar: one collection, as long as it took; scale: "
        f"{longest / 1000:.1f} s across)</text>",
    ]
    for i, (events, spec) in enumerate(zip(buckets, rounds)):
        y = 40 + row * i
        total = sum(t for _, t in events)
        colour = "#c0392b" if spec[3].lower() == "lily" else "#2471a3"
        out.append(f'<text x="10" y="{y + 14}">{spec[3]} {spec[2]} %: {total} ms</text>')
        out.append(f'<line x1="{left}" y1="{y + 10}" x2="{width - 20}" y2="{y + 10}" stroke="#ddd"/>')
        start = events[0][0] - events[0][1] if events else 0
        for at, took in events:
            x = left + (at - took - start) * scale
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{max(took * scale, 1):.1f}" '
                       f'height="20" fill="{colour}"><title>{took} ms</title></rect>')
    out.append("</svg>")
    with open(svg, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


def main():
    args = sys.argv[1:]
    if len(args) == 4 and args[0] == "record":
        record(args[1], float(args[2]), args[3])
    elif len(args) == 4 and args[0] == "report":
        report(args[1], args[2], args[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
