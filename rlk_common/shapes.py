"""The benchmark shapes (docs/design.md §6): name -> (tokens n, hidden h, local vocab V)."""

SHAPES = {"T1": (796, 2048, 75968), "T2": (1820, 2048, 75968), "T3": (6827, 2048, 75968),
          "T3-tp1": (6827, 2048, 151936), "Q8B-tp4": (4096, 4096, 37984), "L16k": (16384, 4096, 151936),
          "H200-pub": (4096, 4096, 128256)}
