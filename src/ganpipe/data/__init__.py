"""Datasets: sources -> converted pixels -> LMDB (prepare), and the LMDB dataset (read).

Import the submodules directly (``ganpipe.data.prepare``, ``ganpipe.data.dataset``): this
package keeps its own import light so decoding workers start fast.
"""
