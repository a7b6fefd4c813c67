"""Request routing over N kvstitch replicas by chunk affinity, the baselines, and a simulator running the same
routers over a synthetic trace (`router`, `view`, `tier`, `trace`, `costs`, `simulate`, `report`); `live` runs the
same chunk affinity on live replicas (`kvstitch serve --replicas`)."""

from .router import ROUTERS, ChunkAffinity, PowerOfTwo, PrefixAffinity, Request, RoundRobin, Router
from .tier import LRU, EvictionPolicy, MemoryTier
from .view import BloomFilter, HoldingsView

__all__ = ["ROUTERS", "BloomFilter", "ChunkAffinity", "EvictionPolicy", "HoldingsView", "LRU", "MemoryTier",
           "PowerOfTwo", "PrefixAffinity", "Request", "RoundRobin", "Router"]
