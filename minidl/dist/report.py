"""What a data-parallel run reports (JSON keys of `minidl train` under mpiexec)."""
from __future__ import annotations


def dist_json(sess, result) -> dict:
    """Ranks, global batch, the job's throughput (ranks x batch / this rank's median step: the all-reduce keeps
    the ranks in step) and the all-reduce's cost as this rank measured it."""
    comm, reducer = sess.comm, sess.executor.reducer
    rate = f"{result.unit}_per_s"
    out = {"dist": comm.kind, "ranks": comm.size, "rank": comm.rank, "global_batch": sess.batch * comm.size,
           f"{rate}_per_rank": result.throughput, rate: result.throughput * comm.size, "unit": result.unit}
    if reducer is not None:
        out.update(reducer.stats.to_json())
    return out


def dist_line(out: dict) -> str:
    """The text line `minidl train` adds under mpiexec (from `dist_json`'s keys)."""
    line = (f"{out['ranks']} rank(s) ({out['dist']}), global batch {out['global_batch']}: "
            f"{out[out['unit'] + '_per_s']:.1f} {out['unit']}/s in all")
    if "allreduce_buckets" in out:
        line += (f"; {out['allreduce_bytes_per_step'] / 2**20:.2f} MiB of gradients per step in "
                 f"{out['allreduce_buckets_per_step']} buckets, "
                 f"{out['allreduce_hidden_fraction']:.0%} of their time hidden behind backward")
    return line
