"""Rows between Arrow batches and Python values, as the RDD route makes them.

The Arrow route hands a partition its rows as Arrow batches and takes its outputs back as
Arrow batches. Both directions must give what the RDD route gives, so that a function does
not change behaviour with pyarrow installed:

- in: a row reaches the function as ``Row.asDict(recursive=True)`` does: maps as dicts
  (Arrow's `to_pylist` gives lists of pairs; struct keys as Rows), timestamps as naive
  datetimes in the worker's local time (Arrow's are aware, in the session time zone),
  converted by PySpark's own `TimestampType.fromInternal`;
- out: an emitted value is checked against `output_schema` as `createDataFrame` checks it
  (type, nullability, length, naming the field), and becomes a row by field name (a dict,
  an object's attributes) or by position (a tuple, a list, a Row), each value on its own;
  timestamps become microseconds through PySpark's own `toInternal` (a naive datetime is
  local time for `timestamp`, wall clock for `timestamp_ntz`, as `createDataFrame` reads
  them; Arrow would read both as UTC).

Only the types that differ are converted; a schema without them costs nothing per row.
"""

from __future__ import annotations

import calendar
import datetime
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ArrowOutput", "OutputCheck", "input_converter"]

_Convert = Callable[[Any], Any]


# -- in: Arrow's Python values -> the RDD route's ------------------------------------------

def _naive_local(value: datetime.datetime | None) -> datetime.datetime | None:
    """An Arrow timestamp (aware) as `Row` gives it: from its microseconds, by PySpark."""
    if value is None:
        return None
    from pyspark.sql.types import TimestampType

    micros = calendar.timegm(value.utctimetuple()) * 1_000_000 + value.microsecond
    converted: datetime.datetime = TimestampType().fromInternal(micros)
    return converted


def _from_arrow(data_type: Any) -> _Convert | None:
    """The conversion of one Arrow value of Spark type `data_type`; None when there is none."""
    from pyspark.sql import types as t

    if isinstance(data_type, t.TimestampType):
        return _naive_local
    if isinstance(data_type, t.ArrayType):
        return _each(_from_arrow(data_type.elementType))
    if isinstance(data_type, t.MapType):
        key = _key_from_arrow(data_type.keyType)
        value = _from_arrow(data_type.valueType) or _same
        return lambda v: None if v is None else {key(k): value(x) for k, x in v}
    if isinstance(data_type, t.StructType):
        fields = _field_converters(data_type)
        if not fields:
            return None
        return lambda v: None if v is None else _convert_fields(v, fields)
    return None


def _same(value: Any) -> Any:
    return value


def _key_from_arrow(data_type: Any) -> _Convert:
    """A map key's conversion: a struct key is a Row (hashable), as on the RDD route."""
    from pyspark.sql import Row
    from pyspark.sql import types as t

    if isinstance(data_type, t.StructType):
        fields = [(f.name, _key_from_arrow(f.dataType)) for f in data_type.fields]
        return lambda v: None if v is None else Row(**{n: c(v[n]) for n, c in fields})
    return _from_arrow(data_type) or _same


def _each(element: _Convert | None) -> _Convert | None:
    """The conversion of a list whose elements convert by `element` (None: none)."""
    if element is None:
        return None
    return lambda v: None if v is None else [element(x) for x in v]


def _field_converters(schema: Any) -> list[tuple[str, _Convert]]:
    return [(f.name, c) for f in schema.fields if (c := _from_arrow(f.dataType)) is not None]


def _convert_fields(row: dict[str, Any], fields: Sequence[tuple[str, _Convert]]) -> dict[str, Any]:
    for name, convert in fields:
        row[name] = convert(row[name])
    return row


def input_converter(schema: Any) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """A function turning a row of `batch.to_pylist()` (of a DataFrame of Spark schema
    `schema`) into what the RDD route gives; None when they are the same already."""
    fields = _field_converters(schema)
    if not fields:
        return None
    return lambda row: _convert_fields(row, fields)


# -- out: emitted values -> an Arrow batch of output_schema --------------------------------

def _to_arrow(data_type: Any) -> _Convert | None:
    """The conversion of one checked Python value of Spark type `data_type` into what
    pyarrow reads as the RDD route would; None when there is none."""
    from pyspark.sql import types as t

    if isinstance(data_type, (t.TimestampType, t.TimestampNTZType)):
        return data_type.toInternal
    if isinstance(data_type, t.ArrayType):
        return _each(_to_arrow(data_type.elementType))
    if isinstance(data_type, t.MapType):
        key = _to_arrow(data_type.keyType)
        value = _to_arrow(data_type.valueType)
        if key is None and value is None:
            return None
        k, x = key or _same, value or _same
        return lambda v: None if v is None else [(k(a), x(b)) for a, b in v.items()]
    if isinstance(data_type, t.StructType):
        # pyarrow takes a struct column's values all as dicts or all as tuples: dicts, always.
        names = data_type.names
        converts = [_to_arrow(f.dataType) or _same for f in data_type.fields]
        return lambda v: None if v is None else {
            n: c(x) for n, c, x in zip(names, converts, _by_field(v, names), strict=True)}
    return None


def _by_field(value: Any, names: Sequence[str]) -> Sequence[Any]:
    """A checked struct value's field values in schema order (as StructType.toInternal)."""
    if isinstance(value, dict):
        return [value.get(n) for n in names]
    if isinstance(value, (tuple, list)):
        return value
    attributes = value.__dict__
    return [attributes.get(n) for n in names]


class OutputCheck:
    """Checks emitted values against `output_schema` (a StructType) as `createDataFrame`
    does, with PySpark's own messages naming the field; made in the worker on first use."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self._verify: _Convert | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"schema": self.schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["schema"])  # type: ignore[misc]

    def __call__(self, values: list[Any]) -> None:
        verify = self._verify
        if verify is None:
            from pyspark.sql.types import _make_type_verifier

            verify = self._verify = _make_type_verifier(self.schema)
        for value in values:
            verify(value)


class ArrowOutput(OutputCheck):
    """Emitted values -> Arrow batches of `output_schema` (a StructType), checked first."""

    def __init__(self, schema: Any, arrow_schema: Any) -> None:
        super().__init__(schema)
        self.arrow_schema = arrow_schema
        self._converts = [_to_arrow(f.dataType) for f in schema.fields]

    def __getstate__(self) -> dict[str, Any]:
        return {"schema": self.schema, "arrow_schema": self.arrow_schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["schema"], state["arrow_schema"])  # type: ignore[misc]

    def batch(self, values: list[Any]) -> Any:
        """One Arrow record batch of `values`; PySpark's own error naming the field for a
        value that does not fit the schema."""
        import pyarrow as pa

        self(values)
        names = self.schema.names
        rows = [_by_field(value, names) for value in values]
        columns: list[Sequence[Any]] = list(zip(*rows, strict=True)) if rows else \
            [() for _ in names]
        arrays = []
        for column, field, convert in zip(columns, self.arrow_schema, self._converts,
                                          strict=True):
            values_of = column if convert is None else [convert(v) for v in column]
            arrays.append(pa.array(values_of, type=field.type))
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)
