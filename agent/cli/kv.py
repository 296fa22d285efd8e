"""``liubai kv``: the prefix cache's disk tier on this machine: its size, and clearing it.

The tier itself is :mod:`runtime.kv.disk_tier`; its files are rebuilt by use, so clearing only
costs the next runs their warm start.
"""

import argparse
import json
import sys

from agent.errors import EXIT_OK


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = commands.add_parser(
        "kv",
        help="the KV disk tier: its size, or clear it",
        description="Show the disk tier of the prefix cache (block files of every model and KV dtype, "
        "under LIUBAI_KV_DISK_DIR or the user cache), or clear it. Its size limit is each run's "
        "--kv-disk.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    sub = p.add_subparsers(dest="kv_command", metavar="ACTION")
    sub.add_parser("clear", help="remove every block file")
    sub.add_parser("path", help="print the tier's directory")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from runtime.kv.disk_tier import clear, default_root, scan
    from runtime.sizes import format_bytes

    root = default_root()
    if args.kv_command == "path":
        print(root)
    elif args.kv_command == "clear":
        num_files, num_bytes = clear(root)
        if args.json:
            print(json.dumps({"root": str(root), "removed_blocks": num_files, "removed_bytes": num_bytes}))
        else:
            print(f"removed {num_files:,} blocks ({format_bytes(num_bytes)}) from {root}")
    else:
        by_fingerprint: dict[str, list[int]] = {}
        for _mtime, path, size in scan(root):
            entry = by_fingerprint.setdefault(path.parent.name, [0, 0])
            entry[0] += 1
            entry[1] += size
        num_blocks = sum(n for n, _ in by_fingerprint.values())
        num_bytes = sum(b for _, b in by_fingerprint.values())
        if args.json:
            fingerprints = [
                {"fingerprint": f, "blocks": n, "bytes": b} for f, (n, b) in by_fingerprint.items()
            ]
            report = {
                "root": str(root),
                "blocks": num_blocks,
                "bytes": num_bytes,
                "fingerprints": fingerprints,
            }
            print(json.dumps(report))
        else:
            print(f"{root}: {num_blocks:,} blocks, {format_bytes(num_bytes)} ({num_bytes:,} bytes)")
            for fp, (n, b) in sorted(by_fingerprint.items(), key=lambda item: -item[1][1]):
                print(f"  {fp}  {n:,} blocks  {format_bytes(b)}", file=sys.stdout)
    return EXIT_OK
