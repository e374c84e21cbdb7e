"""Ordered subjects: route tables, partitions, command messages and ordered pulls."""
