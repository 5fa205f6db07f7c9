//! Slurm's compressed host and task lists: `node[01-04,07],gpu5` and `4(x2),3`.

/// Expands a Slurm node list (`SLURM_JOB_NODELIST`): `a[01-03],b7` → `a01 a02 a03 b7`; several
/// bracket groups in one name expand to their product (`r[1-2]n[1-2]` → `r1n1 r1n2 r2n1 r2n2`).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            return Err(format!("empty host name in {list:?}"));
        }
        hosts.extend(expand_item(item)?);
    }
    if hosts.is_empty() {
        return Err("the node list is empty".into());
    }
    Ok(hosts)
}

/// Splits at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested '[' in {list:?}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("unmatched ']' in {list:?}")),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unclosed '[' in {list:?}"));
    }
    items.push(&list[start..]);
    Ok(items)
}

fn expand_item(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else {
        return Ok(vec![item.to_string()]);
    };
    let close = open
        + item[open..]
            .find(']')
            .ok_or_else(|| format!("unclosed '[' in {item:?}"))?;
    let prefix = &item[..open];
    let suffixes = expand_item(&item[close + 1..])?;
    let mut out = Vec::new();
    for range in item[open + 1..close].split(',') {
        for number in expand_range(range).map_err(|e| format!("{e} in {item:?}"))? {
            for suffix in &suffixes {
                out.push(format!("{prefix}{number}{suffix}"));
            }
        }
    }
    Ok(out)
}

/// `07` → `07`; `01-03` → `01 02 03` (the start's width is kept as zero padding).
fn expand_range(range: &str) -> Result<Vec<String>, String> {
    let parse = |s: &str| {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            Err(format!("{s:?} is not a number"))
        } else {
            s.parse::<u64>().map_err(|_| format!("{s:?} is too large"))
        }
    };
    let (first, last) = match range.split_once('-') {
        Some((a, b)) => (a, b),
        None => (range, range),
    };
    let (start, end) = (parse(first)?, parse(last)?);
    if end < start {
        return Err(format!("range {range:?} runs backwards"));
    }
    if end - start >= 1 << 16 {
        return Err(format!("range {range:?} has more than 65536 hosts"));
    }
    let width = first.len();
    Ok((start..=end).map(|n| format!("{n:0width$}")).collect())
}

/// Expands `SLURM_TASKS_PER_NODE` (`2(x3),1` → `2 2 2 1`).
pub fn expand_tasks_per_node(list: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for item in list.split(',') {
        let (count, repeat) = match item.split_once("(x") {
            Some((count, rest)) => {
                let repeat = rest
                    .strip_suffix(')')
                    .ok_or_else(|| format!("{item:?} lacks its closing ')'"))?;
                (
                    count,
                    repeat
                        .parse::<usize>()
                        .map_err(|_| format!("bad repeat in {item:?}"))?,
                )
            }
            None => (item, 1),
        };
        let count = count
            .parse::<usize>()
            .map_err(|_| format!("{count:?} is not a task count"))?;
        if repeat > 1 << 16 {
            return Err(format!("repeat {repeat} in {item:?} is too large"));
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(out)
}
