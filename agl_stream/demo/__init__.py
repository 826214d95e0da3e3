"""The main job, ``agl-stream demo``: the whole RL loop on CPU, on a toy task that visibly learns."""
