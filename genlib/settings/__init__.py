"""Generation settings: their declaration, presets and provenance."""
