"""Radix prefix cache over token ids at page granularity, shared by all sessions of an engine.

Each edge below the root is exactly one full page: ``page_size`` token ids and the pool page holding their KV.
The KV of a position depends on every earlier token, so a page is reusable only under the same path from the root —
which is what the tree encodes. The tree holds one reference on each of its pages; sessions hold their own.

What mutates: ``match_prefix`` touches access times; ``insert`` adds nodes (and references); ``lock/unlock``
change pin counts along a path; ``evict`` removes unpinned leaves (LRU first) and drops their references.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from freetoken_agent.runtime.kv.pool import PagePool


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    page: int
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    locks: int = 0
    last_access: int = 0


@dataclass(frozen=True)
class Match:
    """Result of ``match_prefix``: the reusable pages, how many tokens they cover, and the deepest node."""

    pages: list[int]
    length: int
    node: Node


class RadixCache:
    def __init__(self, pool: PagePool) -> None:
        self.pool, self.page_size = pool, pool.page_size
        self.root = Node((), -1, None)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.evicted_pages = 0

    def _chunks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i : i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def match_prefix(self, tokens: list[int]) -> Match:
        """Longest cached page-aligned prefix of ``tokens`` (no references taken; lock or incref to keep it)."""
        node, pages, now = self.root, [], next(self._clock)
        for chunk in self._chunks(tokens):
            child = node.children.get(chunk)
            if child is None:
                break
            child.last_access = now
            pages.append(child.page)
            node = child
        return Match(pages, len(pages) * self.page_size, node)

    def insert(self, tokens: list[int], pages: list[int]) -> Node:
        """Record that ``pages`` hold the KV of ``tokens`` (page-aligned prefix). Existing nodes keep their page."""
        chunks = self._chunks(tokens)
        assert len(chunks) <= len(pages), "insert needs one page per full chunk of tokens"
        node, now = self.root, next(self._clock)
        for chunk, page in zip(chunks, pages):
            child = node.children.get(chunk)
            if child is None:
                child = Node(chunk, page, node)
                node.children[chunk] = child
                self.pool.incref(page)
                self.num_nodes += 1
            child.last_access = now
            node = child
        return node

    def lock(self, node: Node) -> None:
        while node is not self.root and node is not None:
            node.locks += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root and node is not None:
            assert node.locks > 0
            node.locks -= 1
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Drop up to ``num_pages`` unpinned leaves, least recently used first; returns how many were dropped."""
        dropped = 0
        while dropped < num_pages:
            leaves = [n for n in self._nodes() if not n.children and n.locks == 0]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda n: n.last_access):
                if dropped >= num_pages:
                    break
                assert leaf.parent is not None
                del leaf.parent.children[leaf.key]
                self.pool.decref(leaf.page)
                self.num_nodes -= 1
                dropped += 1
        self.evicted_pages += dropped
        return dropped

    def evict_page(self, page: int) -> bool:
        """Drop the node holding ``page`` with everything cached below it (a cached continuation whose first page a
        growing sequence wants next, to stay one run of pages), when none of it is pinned; False otherwise (a pinned
        branch, or a page the tree does not hold)."""
        for node in self._nodes():
            if node.page != page or node.locks:
                continue
            branch = self._nodes(node)
            if any(n.locks for n in branch):
                return False
            assert node.parent is not None
            del node.parent.children[node.key]
            for n in branch:
                self.pool.decref(n.page)
            self.num_nodes -= len(branch)
            self.evicted_pages += len(branch)
            return True
        return False

    def clear(self) -> int:
        """Drop every unpinned node (repeatedly, so whole unpinned branches go)."""
        return self.evict(self.num_nodes)

    def _nodes(self, top: Node | None = None) -> list[Node]:
        """Every node below the root, or ``top`` and every node below it."""
        out, stack = [], [top] if top is not None else list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
