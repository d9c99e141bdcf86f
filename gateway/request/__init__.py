"""The request pipeline every front calls: authenticate, validate params, encode, reserve
limits, relay and detokenize.
"""
