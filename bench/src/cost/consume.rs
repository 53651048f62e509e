//! The `run` child: consumes exactly `N` pre-published orders (prefetch 50) with raw lapin or
//! Lily (the regression gate's two consumers, `lily_mq_regress::consume`), closes, and reports
//! what the counting allocator saw over the whole process.

use lily_mq_regress::consume::{Who, drain, handled};
use serde::{Deserialize, Serialize};

use super::{Contender, alloc_snapshot, runtime};
use crate::broker_url;

/// What a `run` child counted over its whole process.
#[derive(Debug, Serialize, Deserialize)]
pub struct Counted {
    pub handled: usize,
    pub allocations: usize,
    pub reallocations: usize,
    pub bytes_allocated: usize,
}

/// The `run` child: consumes `n` orders from `queue` on a current-thread runtime.
pub fn child(who: Contender, n: usize, queue: &str) -> Result<Counted, String> {
    let (url, rt) = (broker_url(), runtime(false));
    let who = match who {
        Contender::Raw => Who::Raw,
        Contender::Lily => Who::Lily,
    };
    rt.block_on(drain(who, &url, queue, n as u64))?;
    let stats = alloc_snapshot();
    drop(rt);
    Ok(Counted {
        handled: usize::try_from(handled()).expect("a count fits usize"),
        allocations: stats.allocations,
        reallocations: stats.reallocations,
        bytes_allocated: stats.bytes_allocated,
    })
}
