"""Radix prefix cache over token ids at page granularity, shared by all sessions of an engine.

Each edge below the root is exactly one full page: ``page_size`` token ids and the pool page holding their KV.
The KV of a position depends on every earlier token, so a page is reusable only under the same path from the root —
which is what the tree encodes. The tree holds one reference on each of its pages; sessions hold their own.

What mutates: ``match_prefix`` touches access times; ``insert`` adds nodes (and references) and re-points nodes
where that makes a cached path one run of pages again; ``lock/unlock`` change pin counts along a path; ``evict``
removes unpinned leaves (LRU first) and drops their references; ``move_page`` copies a page only the tree holds to a
fresh one (same KV, same node).

Runs: attention reads a sequence's cache as views of the pool only while its page table is one ascending run of page
ids (``PagedKVCache``), so a cached path is worth most as a run: an adopter of a run grows in place. A request that
re-sends a cached prompt (a session-less client's next turn, a retry) adopts the prompt's full pages and must write
the page after them, which the tree holds (the prompt's last page and the reply after it): moving that small tail
aside (``move_page``, one page each) lets it grow in place instead of copying its whole prefix into a fresh run; when
it finishes, ``insert`` points the moved nodes at its pages, so the path is one run again. A tail is moved only when
fewer pages of cached paths run through it than the grower would copy instead: moving a page in the middle of a long
cached path (a short request branching off a long prompt's first page) would break that path for every later
request over it.
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
        self.moved_pages = 0
        self.repointed_pages = 0
        self.move_tails = True
        """``move_page`` moves anything at all (False: a grower over a cached tail copies its prefix instead, as
        before tails moved; ``freetoken bench resend`` compares the two)."""
        self._by_page: dict[int, Node] = {}
        """Pool page → the node holding it."""

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
        """Record that ``pages`` hold the KV of ``tokens`` (page-aligned prefix). Existing nodes keep their page,
        except where the cached path breaks its run there (the node's page does not follow its parent's) and the
        given page does follow: the node takes the given page (the same tokens' KV) and lets its own go."""
        chunks = self._chunks(tokens)
        assert len(chunks) <= len(pages), "insert needs one page per full chunk of tokens"
        node, now = self.root, next(self._clock)
        for chunk, page in zip(chunks, pages):
            child = node.children.get(chunk)
            if child is None:
                child = Node(chunk, page, node)
                node.children[chunk] = child
                self.pool.incref(page)
                self._by_page[page] = child
                self.num_nodes += 1
            elif (node is not self.root and child.page != page and child.page != node.page + 1
                  and page == node.page + 1 and page not in self._by_page):
                self.pool.incref(page)
                self._set_page(child, page)
                self.repointed_pages += 1
            child.last_access = now
            node = child
        return node

    def _set_page(self, node: Node, page: int) -> None:
        """Point ``node`` at ``page`` (its reference taken by the caller) and drop its reference to the old one."""
        if self._by_page.get(node.page) is node:
            del self._by_page[node.page]
        self.pool.decref(node.page)
        node.page = page
        self._by_page[page] = node

    def _drop(self, node: Node) -> None:
        """Forget ``node``'s page (the node is being removed; the caller drops the reference)."""
        if self._by_page.get(node.page) is node:
            del self._by_page[node.page]

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
                self._drop(leaf)
                self.pool.decref(leaf.page)
                self.num_nodes -= 1
                dropped += 1
        self.evicted_pages += dropped
        return dropped

    def evict_page(self, page: int) -> bool:
        """Drop the node holding ``page`` with everything cached below it (a cached continuation whose first page a
        growing sequence wants next, to stay one run of pages), when none of it is pinned; False otherwise (a pinned
        branch, or a page the tree does not hold)."""
        node = self._by_page.get(page)
        if node is None or node.locks:
            return False
        branch = self._nodes(node)
        if any(n.locks for n in branch):
            return False
        assert node.parent is not None
        del node.parent.children[node.key]
        for n in branch:
            self._drop(n)
            self.pool.decref(n.page)
        self.num_nodes -= len(branch)
        self.evicted_pages += len(branch)
        return True

    def move_page(self, page: int, limit: int) -> bool:
        """Let go of ``page`` without losing what it caches: when the tree is its only holder and fewer than
        ``limit`` cached pages run through it (its node and every node below), copy its KV to a fresh page and
        point the node there, so ``page`` is free (for a sequence that grows into it to stay one run, where it
        would otherwise copy its ``limit`` pages into a free run). False otherwise (nothing moved): a page the tree
        does not hold, one someone else holds too, a long cached path through it, no free page."""
        node = self._by_page.get(page)
        if not self.move_tails or node is None or self.pool.refs[page] != 1 or not self.pool.num_free:
            return False
        count, stack = 0, [node]
        while stack:  # the node's subtree, counted up to the limit
            count += 1
            if count >= limit:
                return False
            stack.extend(stack.pop().children.values())
        fresh = self.pool.alloc()  # the most recently freed page: memory already touched, likely still in cache
        if fresh == page + 1 and self.pool.num_free:  # the page the grower wants after this one: take another
            fresh, spare = self.pool.alloc(), fresh
            self.pool.decref(spare)
        self.pool.copy_page(page, fresh)
        self._set_page(node, fresh)
        self.moved_pages += 1
        return True

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
