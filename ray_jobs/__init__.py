"""Ray orchestration: Data preprocessing, Train launch, Tune grid, batch evaluation. Thin; calls clozemath."""
