"""Cost of prefix-cache keys for one prompt: the old Python ``hash()`` chain vs the blake2b chain.

    python -m bench.block_hash [--tokens 2048] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
import timeit

from engine.block_manager import BlockManager


def old_chain(tokens: list[int], block_size: int) -> list[int]:
    """The keys before: ``hash((parent hash, block tokens))`` from a constant root."""
    parent, keys = 0x5BEC, []
    for i in range(len(tokens) // block_size):
        key = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        keys.append(key)
        parent = hash(key)
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(args.tokens)]
    bm = BlockManager(1, args.block_size)
    num_blocks = args.tokens // args.block_size
    root = b"\0" * 16

    def new_chain() -> list:
        return list(bm._key_chain(tokens, root, 0, num_blocks))

    for name, fn in (("old hash() chain", lambda: old_chain(tokens, args.block_size)), ("blake2b chain", new_chain)):
        best = min(timeit.repeat(fn, number=args.repeat, repeat=5)) / args.repeat
        print(f"{name:18s} {args.tokens} tokens / {num_blocks} blocks: {best * 1e6:8.1f} us per prompt "
              f"({best * 1e9 / num_blocks:6.0f} ns per block)")


if __name__ == "__main__":
    main()
