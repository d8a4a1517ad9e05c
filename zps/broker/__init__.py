"""The broker process: routes requests to primaries, holds the cluster map, watches shards,
promotes replicas and coordinates training jobs."""
