from .mckp import Infeasible, exact, lagrangian

__all__ = ["Infeasible", "lagrangian", "exact"]
