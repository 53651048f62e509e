#!/usr/bin/env python3
"""How long the broker took to confirm each publish, read off a packet capture.

The benchmarks time a copy from the client's side: from its publish to the confirm the client
saw. This reads the AMQP 0-9-1 frames of a loopback capture instead, so the time a publish
waited in the broker can be told apart from the time the client took to write it or to see
its confirm.

    tcpdump -i lo -w /tmp/run.pcap 'tcp port 25692' &    # while a benchmark runs
    python3 bench/tools/confirms_on_the_wire.py /tmp/run.pcap 25692

Needs tcpdump and the `dpkt` Python package; neither is installed by the project's scripts, and
no test or benchmark uses this. For every connection, and every routing key published to on a
channel in confirm mode, it prints: publishes confirmed, the time from the packet carrying the
publish to the packet carrying its confirm (p50, p99, max; share over 50 ms), and the publishes
waiting for a confirm, sampled every 10 ms. Message bodies are not read.
"""

import collections
import struct
import sys

import dpkt

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
METHOD = 1
CONFIRM_SELECT = (85, 10)
BASIC_PUBLISH = (60, 40)
BASIC_ACK = (60, 80)
BASIC_NACK = (60, 120)


def frames(buffers, key, data):
    """Appends `data` to the stream `key` and yields each complete method frame in it."""
    buf = buffers[key] + data
    i = 0
    while len(buf) - i >= 7:
        if buf[i : i + 8] == PROTOCOL_HEADER:
            i += 8
            continue
        kind, channel, size = struct.unpack(">BHI", buf[i : i + 7])
        if len(buf) - i < 8 + size:
            break
        if kind == METHOD:
            yield channel, buf[i + 7 : i + 7 + size]
        i += 8 + size
    buffers[key] = buf[i:]


def short_string(payload, at):
    n = payload[at]
    return payload[at + 1 : at + 1 + n].decode("utf-8", "replace"), at + 1 + n


def read(path, broker_port):
    """Per (client port, routing key): a list of (publish time, seconds to its confirm)."""
    buffers = collections.defaultdict(bytes)
    next_seq = {}
    confirming = set()
    sequence = collections.Counter()
    waiting = collections.defaultdict(dict)
    confirmed = collections.defaultdict(list)
    with open(path, "rb") as capture:
        for at, raw in dpkt.pcap.Reader(capture):
            ip = dpkt.ethernet.Ethernet(raw).data
            if not isinstance(ip, dpkt.ip.IP) or not isinstance(ip.data, dpkt.tcp.TCP):
                continue
            tcp = ip.data
            if not tcp.data:
                continue
            to_broker = tcp.dport == broker_port
            client = tcp.sport if to_broker else tcp.dport
            key = (client, to_broker)
            if key in next_seq and tcp.seq < next_seq[key]:
                continue  # a retransmission, or loopback's second copy
            next_seq[key] = tcp.seq + len(tcp.data)
            for channel, payload in frames(buffers, key, tcp.data):
                method = struct.unpack(">HH", payload[:4])
                on = (client, channel)
                if to_broker and method == CONFIRM_SELECT:
                    confirming.add(on)
                elif to_broker and method == BASIC_PUBLISH and on in confirming:
                    _, after = short_string(payload, 6)
                    routing_key, _ = short_string(payload, after)
                    sequence[on] += 1
                    waiting[on][sequence[on]] = (at, routing_key)
                elif not to_broker and method in (BASIC_ACK, BASIC_NACK) and on in confirming:
                    tag, bits = struct.unpack(">QB", payload[4:13])
                    pending = waiting[on]
                    tags = [t for t in pending if t <= tag] if bits & 1 else [tag]
                    for t in tags:
                        if t in pending:
                            published, routing_key = pending.pop(t)
                            confirmed[(client, routing_key)].append((published, at - published))
    return confirmed


def percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def outstanding(publishes, step=0.01):
    """Publishes waiting for their confirm, sampled every `step` seconds."""
    events = sorted([(t, 1) for t, _ in publishes] + [(t + took, -1) for t, took in publishes])
    samples, now, due = [], 0, events[0][0]
    for at, change in events:
        while at >= due:
            samples.append(now)
            due += step
        now += change
    return sorted(samples)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: confirms_on_the_wire.py CAPTURE.pcap BROKER_PORT")
    confirmed = read(sys.argv[1], int(sys.argv[2]))
    print("client port | routing key | confirmed | first publish s | p50 ms | p99 ms | max ms "
          "| over 50 ms | waiting p50 / p99 / max")
    first = min((min(t for t, _ in v) for v in confirmed.values()), default=0)
    for (client, routing_key), publishes in sorted(confirmed.items(), key=lambda kv: min(kv[1])):
        took = sorted(1000 * d for _, d in publishes)
        waiting = outstanding(publishes)
        print(
            f"{client} | {routing_key} | {len(took)} | {min(publishes)[0] - first:.1f} "
            f"| {percentile(took, 0.5):.2f} | {percentile(took, 0.99):.2f} | {took[-1]:.2f} "
            f"| {100 * sum(1 for t in took if t > 50) / len(took):.2f} % "
            f"| {percentile(waiting, 0.5)} / {percentile(waiting, 0.99)} / {waiting[-1]}"
        )


if __name__ == "__main__":
    main()
