"""The exceptions rdkv raises for misuse it can explain, one type per kind of problem, so callers catch by
type and never by message text. Every one is an :class:`RDKVError` (itself a ``ValueError``)."""


class RDKVError(ValueError):
    """Bad input or a state rdkv cannot serve; the message says what was wrong and what to do."""


class BudgetInfeasible(RDKVError):
    """The byte budget cannot hold even the cheapest allocation the format allows."""


class NotRecorded(RDKVError):
    """There is no complete prefill record to compress: the record is still open, or saw no full forward."""


class CorruptFile(RDKVError):
    """A file is not a cache this rdkv can read: wrong format or version, truncated, or failing its checksum."""
