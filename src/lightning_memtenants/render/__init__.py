"""Render: the record as a table (text and markdown), as tags, as TensorBoard panels and as a postmortem."""
