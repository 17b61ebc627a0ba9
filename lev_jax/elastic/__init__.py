"""Elastic depth: a decision read out after a chosen layer (`exits`), where compute really stops
there and a shallow answer can be continued deeper without recomputing a layer."""
