#!/usr/bin/env python3
"""Publisher confirms and consumer ACKs, timed off a packet capture.

The benchmarks time a message from the client's side. This reads the AMQP 0-9-1 frames of a
loopback capture instead, so the time a message waited in the broker can be told apart from
the time the client took:

    tcpdump -i lo -w /tmp/run.pcap 'tcp port 25692' &    # while a benchmark runs
    python3 bench/tools/amqp_on_the_wire.py /tmp/run.pcap 25692

Needs tcpdump and the `dpkt` Python package; neither is installed by the project's scripts, and
no test or benchmark uses this. It prints two tables, one row per connection:

- Confirms, per routing key published to on a channel in confirm mode: the time from the
  packet carrying a publish to the packet carrying its confirm (p50, p99, max; share over
  50 ms), and the publishes waiting for their confirm, sampled every 10 ms.
- ACKs, for a connection that consumed: ACKs a frame, the time from the last delivery a frame
  covers to the frame, and the share of the time the consumer held its whole prefetch window
  unACKed (the broker sends nothing then).

Message bodies are not read.
"""

import collections
import struct
import sys

import dpkt

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
METHOD = 1
BASIC_QOS = (60, 10)
BASIC_PUBLISH = (60, 40)
BASIC_DELIVER = (60, 60)
BASIC_ACK = (60, 80)
BASIC_NACK = (60, 120)
CONFIRM_SELECT = (85, 10)


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
            yield channel, struct.unpack(">HH", buf[i + 7 : i + 11]), buf[i + 11 : i + 7 + size]
        i += 8 + size
    buffers[key] = buf[i:]


def short_string(args, at):
    n = args[at]
    return args[at + 1 : at + 1 + n].decode("utf-8", "replace"), at + 1 + n


class Wire:
    """What the capture shows of every connection to the broker."""

    def __init__(self):
        self.confirming = set()
        self.sequence = collections.Counter()
        self.waiting = collections.defaultdict(dict)
        # (client, routing key) -> [(publish time, seconds to its confirm)]
        self.confirmed = collections.defaultdict(list)
        self.prefetch = {}
        # client -> {delivery tag: time}; client -> [(time, tag, multiple)]
        self.delivered = collections.defaultdict(dict)
        self.acks = collections.defaultdict(list)

    def from_client(self, at, client, channel, method, args):
        on = (client, channel)
        if method == CONFIRM_SELECT:
            self.confirming.add(on)
        elif method == BASIC_PUBLISH and on in self.confirming:
            _, after = short_string(args, 2)
            routing_key, _ = short_string(args, after)
            self.sequence[on] += 1
            self.waiting[on][self.sequence[on]] = (at, routing_key)
        elif method == BASIC_QOS:
            self.prefetch[client] = struct.unpack(">H", args[4:6])[0]
        elif method == BASIC_ACK:
            tag, bits = struct.unpack(">QB", args[:9])
            self.acks[client].append((at, tag, bits & 1))

    def from_broker(self, at, client, channel, method, args):
        on = (client, channel)
        if method in (BASIC_ACK, BASIC_NACK) and on in self.confirming:
            tag, bits = struct.unpack(">QB", args[:9])
            pending = self.waiting[on]
            for t in [t for t in pending if t <= tag] if bits & 1 else [tag]:
                if t in pending:
                    published, routing_key = pending.pop(t)
                    self.confirmed[(client, routing_key)].append((published, at - published))
        elif method == BASIC_DELIVER:
            _, after = short_string(args, 0)
            self.delivered[client][struct.unpack(">Q", args[after : after + 8])[0]] = at


def read(path, broker_port):
    wire = Wire()
    buffers = collections.defaultdict(bytes)
    next_seq = {}
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
            handle = wire.from_client if to_broker else wire.from_broker
            for channel, method, args in frames(buffers, key, tcp.data):
                handle(at, client, channel, method, args)
    return wire


def percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def waiting_samples(publishes, step=0.01):
    """Publishes waiting for their confirm, sampled every `step` seconds."""
    events = sorted([(t, 1) for t, _ in publishes] + [(t + took, -1) for t, took in publishes])
    samples, now, due = [], 0, events[0][0]
    for at, change in events:
        while at >= due:
            samples.append(now)
            due += step
        now += change
    return sorted(samples)


def window_full_share(delivered, acks, prefetch):
    """Share of the time from the first delivery to the last ACK with `prefetch` unACKed."""
    events = sorted(
        [(t, 0, tag) for tag, t in delivered.items()] + [(t, 1, tag) for t, tag, _ in acks]
    )
    highest = acked = 0
    full = 0.0
    last = events[0][0]
    for at, kind, tag in events:
        if highest - acked >= prefetch:
            full += at - last
        last = at
        if kind == 0:
            highest = max(highest, tag)
        else:
            acked = max(acked, tag)
    return full / max(events[-1][0] - events[0][0], 1e-9)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: amqp_on_the_wire.py CAPTURE.pcap BROKER_PORT")
    wire = read(sys.argv[1], int(sys.argv[2]))
    starts = [t for v in wire.confirmed.values() for t, _ in v] + [
        t for v in wire.delivered.values() for t in v.values()
    ]
    first = min(starts, default=0)

    print("Confirms: client port | routing key | confirmed | from s | p50 ms | p99 ms | max ms "
          "| over 50 ms | waiting p50 / p99 / max")
    by_start = sorted(wire.confirmed.items(), key=lambda kv: min(kv[1]))
    for (client, routing_key), publishes in by_start:
        took = sorted(1000 * d for _, d in publishes)
        waiting = waiting_samples(publishes)
        print(
            f"{client} | {routing_key} | {len(took)} | {min(publishes)[0] - first:.1f} "
            f"| {percentile(took, 0.5):.2f} | {percentile(took, 0.99):.2f} | {took[-1]:.2f} "
            f"| {100 * sum(1 for t in took if t > 50) / len(took):.2f} % "
            f"| {percentile(waiting, 0.5)} / {percentile(waiting, 0.99)} / {waiting[-1]}"
        )

    print("\nACKs: client port | deliveries | from s | ACK frames | ACKs a frame "
          "| last delivery to its frame p50 / p99 ms | prefetch | window full")
    for client, delivered in sorted(wire.delivered.items(), key=lambda kv: min(kv[1].values())):
        acks = wire.acks[client]
        if not acks:
            continue
        delays = sorted(1000 * (t - delivered[tag]) for t, tag, _ in acks if tag in delivered)
        prefetch = wire.prefetch.get(client)
        full = f"{100 * window_full_share(delivered, acks, prefetch):.0f} %" if prefetch else "-"
        print(
            f"{client} | {len(delivered)} | {min(delivered.values()) - first:.1f} | {len(acks)} "
            f"| {len(delivered) / len(acks):.1f} "
            f"| {percentile(delays, 0.5):.2f} / {percentile(delays, 0.99):.2f} "
            f"| {prefetch or '-'} | {full}"
        )


if __name__ == "__main__":
    main()
