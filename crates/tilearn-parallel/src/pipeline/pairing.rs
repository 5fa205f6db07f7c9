//! Which receive each send meets. Like NCCL's point-to-point semantics, the messages of one
//! directed link (stage a → stage b) match in the order they are posted: the k-th send from a to
//! b meets the k-th receive on b from a. This checks that the two ends agree on every message and
//! records, for every batch, the batches on other stages its operations meet.

use std::collections::BTreeMap;

use super::dataflow::{Endpoint, Shape};
use super::error::{Result, ScheduleError};
use super::schedule::{Action, P2p};

/// For every stage and action index, the (stage, action index) of the batches its operations
/// meet (empty for computes).
pub(crate) type Partners = Vec<Vec<Vec<(usize, usize)>>>;

/// One end of one message: the stage, its action index and the operation.
type Posted = (usize, usize, P2p);

/// Pairs every send with its receive, or says which message of which link disagrees.
pub(crate) fn pair(shape: Shape, actions: &[Vec<Action>]) -> Result<Partners> {
    // (from, to) → (sends posted by `from`, receives posted by `to`), in program order.
    let mut links: BTreeMap<(usize, usize), (Vec<Posted>, Vec<Posted>)> = BTreeMap::new();
    for (stage, program) in actions.iter().enumerate() {
        for (index, action) in program.iter().enumerate() {
            let Action::Comm(ops) = action else { continue };
            for op in ops {
                if op.peer_stage >= shape.stages || op.peer_stage == stage {
                    return Err(ScheduleError::Invalid {
                        stage,
                        action: index,
                        reason: format!(
                            "{op}: the peer must be another of the {} stages",
                            shape.stages
                        ),
                    });
                }
                if op.kind.is_send() {
                    let link = links.entry((stage, op.peer_stage)).or_default();
                    link.0.push((stage, index, *op));
                } else {
                    let link = links.entry((op.peer_stage, stage)).or_default();
                    link.1.push((stage, index, *op));
                }
            }
        }
    }
    let mut partners: Partners = actions.iter().map(|p| vec![Vec::new(); p.len()]).collect();
    for ((from, to), (sends, receives)) in links {
        for (number, (send, receive)) in sends.iter().zip(&receives).enumerate() {
            if !matches(shape, send, receive) {
                return Err(ScheduleError::Unpaired {
                    from,
                    to,
                    reason: format!(
                        "message {number}: stage {from} action {} posts \"{}\" but the matching \
                         receive, stage {to} action {}, is \"{}\" (both ends must list a link's \
                         messages in the same order)",
                        send.1, send.2, receive.1, receive.2
                    ),
                });
            }
            partners[send.0][send.1].push((receive.0, receive.1));
            partners[receive.0][receive.1].push((send.0, send.1));
        }
        if sends.len() != receives.len() {
            let (extra, side) = if sends.len() > receives.len() {
                (&sends[receives.len()], "receive")
            } else {
                (&receives[sends.len()], "send")
            };
            return Err(ScheduleError::Unpaired {
                from,
                to,
                reason: format!(
                    "{} sends and {} receives: \"{}\" (stage {} action {}) has no matching {side}",
                    sends.len(),
                    receives.len(),
                    extra.2,
                    extra.0,
                    extra.1
                ),
            });
        }
    }
    Ok(partners)
}

/// Whether a send and a receive carry the same tensor: same micro-batch, same kind of payload,
/// and the receiver's chunk is the one the sender's chunk feeds.
fn matches(shape: Shape, send: &Posted, receive: &Posted) -> bool {
    let (from, _, s) = *send;
    let (to, _, r) = *receive;
    s.micro_batch == r.micro_batch
        && s.kind.is_activation() == r.kind.is_activation()
        && shape.partner(from, s.chunk, s.kind)
            == Some(Endpoint {
                stage: to,
                chunk: r.chunk,
            })
}
