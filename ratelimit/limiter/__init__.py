"""The limiter: token-bucket algorithm, its Lua and storage, reserve/settle with failure
modes, denial memory.
"""
