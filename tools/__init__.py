"""Repository tools that are neither product nor tests: the generated package map
(`python -m tools.package_map`)."""
