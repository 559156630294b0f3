"""Actors the docstring examples use without defining them (importable by the workers)."""

from __future__ import annotations

import mesharray as ma


class Counter(ma.Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start

    @ma.endpoint
    def incr(self, by: int = 1) -> None:
        self.value += by

    @ma.endpoint
    def get(self) -> int:
        return self.value


class Echo(ma.Actor):
    @ma.endpoint
    def echo(self, x):
        return x
