"""A model's values outside the cluster: the export format (:mod:`zps.model.format`) and
offline export from shards' data dirs (:mod:`zps.model.offline`)."""

from zps.model.format import Export, ExportWriter

__all__ = ["Export", "ExportWriter"]
