//! Which examples share a packed row: best-fit decreasing, the strategy TRL's `packing=True`
//! uses by default (`packing_strategy="bfd"`). Examples are taken longest first (ties in input
//! order) and each goes into the open row with the least room that still fits it, or a new
//! row. Deterministic; `O(n log n)` with the open rows kept in an ordered map by free space.

use std::collections::BTreeMap;

/// Rows of at most `row_len` tokens holding every example of `lengths` (each at most
/// `row_len` and at least 1): the example indices of each row, in input order within a row and
/// rows ordered by their first example. `None` when an example does not fit a row.
pub fn best_fit_decreasing(lengths: &[usize], row_len: usize) -> Option<Vec<Vec<usize>>> {
    if lengths.iter().any(|&l| l == 0 || l > row_len) {
        return None;
    }
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    // Stable: equal lengths keep their input order.
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]));
    let mut rows: Vec<Vec<usize>> = Vec::new();
    // Free space -> the rows with that much room (a stack: the newest such row first).
    let mut by_room: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for e in order {
        let len = lengths[e];
        let fit = by_room.range(len..).next().map(|(&room, _)| room);
        let (row, room) = match fit {
            Some(room) => {
                let rows_with_room = by_room.get_mut(&room).expect("listed");
                let row = rows_with_room.pop().expect("non-empty");
                if rows_with_room.is_empty() {
                    by_room.remove(&room);
                }
                (row, room)
            }
            None => {
                rows.push(Vec::new());
                (rows.len() - 1, row_len)
            }
        };
        rows[row].push(e);
        let left = room - len;
        if left > 0 {
            by_room.entry(left).or_default().push(row);
        }
    }
    for row in &mut rows {
        row.sort_unstable();
    }
    rows.sort_unstable_by_key(|r| r[0]);
    Some(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_longest_first_into_the_tightest_row() {
        // Row length 10: 7 opens a row, 6 another, 4 fits the 6 (room 4, the tightest), 3 the
        // 7 (room 3), 2 a new row (no room left anywhere), 1 that row.
        let rows = best_fit_decreasing(&[3, 7, 2, 6, 4, 1], 10).unwrap();
        assert_eq!(rows, vec![vec![0, 1], vec![2, 5], vec![3, 4]]);
        for row in &rows {
            assert!(row.iter().map(|&e| [3, 7, 2, 6, 4, 1][e]).sum::<usize>() <= 10);
        }
        let mut all: Vec<usize> = rows.concat();
        all.sort_unstable();
        assert_eq!(all, (0..6).collect::<Vec<_>>());
    }

    #[test]
    fn refuses_examples_that_do_not_fit() {
        assert!(best_fit_decreasing(&[3, 11], 10).is_none());
        assert!(best_fit_decreasing(&[0], 10).is_none());
        assert_eq!(best_fit_decreasing(&[], 10), Some(vec![]));
    }
}
