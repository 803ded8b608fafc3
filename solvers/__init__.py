from .mckp import exact, lagrangian

__all__ = ["lagrangian", "exact"]
