package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/jackc/pgx/v5"
)

// Retry parking (inbox_parked, migration 00020): one row per parked group.
const (
	sqlParks = `SELECT false, group_id, message_key, failures, retry, due_at, expires_at FROM inbox_parked
WHERE consumer = $1 AND group_id = ANY($2::text[])`
	// Strict order: the parks, and one more row if any group is held (its
	// rows are read only then, in a round trip of their own).
	sqlParksAndHeld = sqlParks + `
UNION ALL
SELECT true, '', '', 0, 0, now(), now() WHERE EXISTS (SELECT 1 FROM inbox_held WHERE consumer = $1 AND group_id = ANY($2::text[]))`
	sqlPark = `INSERT INTO inbox_parked (consumer, group_id, message_key, event_id, sequence, failures, retry, due_at, expires_at, last_error)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (consumer, group_id) DO UPDATE SET message_key = EXCLUDED.message_key, event_id = EXCLUDED.event_id,
    sequence = EXCLUDED.sequence, failures = EXCLUDED.failures, retry = EXCLUDED.retry, due_at = EXCLUDED.due_at,
    expires_at = EXCLUDED.expires_at, last_error = EXCLUDED.last_error, parked_at = now()`
	sqlUnpark = `DELETE FROM inbox_parked WHERE consumer = $1 AND group_id = $2 AND message_key = $3`
	// The group's park, locked for a charge (see charge).
	sqlParkOf = `SELECT message_key, failures, retry FROM inbox_parked WHERE consumer = $1 AND group_id = $2 FOR UPDATE`
)

// errRunAgain: a side effect ran out of its time and took the batch
// transaction with it; the batch runs again at once, that record counted
// as failed without running it again.
var errRunAgain = errors.New("inbox engine: a side effect timed out and broke the batch transaction; running the batch again")

// park is a group's retrying head, as read from inbox_parked.
type park struct {
	key          string
	failures     int
	retry        int
	due, expires time.Time
}

// groupState is what a batch knows of its groups: their parks and, in
// strict order, their holds.
type groupState struct {
	parks map[string]park
	holds *holdSet // nil in relaxed order
}

// decision is what the engine decided for one record; settle carries it out.
type decision struct {
	action   string
	class    string
	err      error
	failures int // the event's failures before this delivery
	retry    Retry
	dead     DeadLetter
	expires  time.Time // deferred: when the head's park expires
	releases bool      // the record was its group's parked head and the group is parked no more
}

func (d decision) settlement() Settlement {
	return Settlement{Action: d.action, Class: d.class, Err: d.err, Failures: d.failures}
}

// unfinishedDecisions hands every record back to a broker that keeps group
// order itself, without counting a failure: not started before a deadline
// (ClassDeadline), or its database work failed for as long as it could
// wait (ClassTransient).
func unfinishedDecisions(batch []*Record, class string) []decision {
	ds := make([]decision, len(batch))
	for i, r := range batch {
		ds[i] = decision{action: ActionDeferred, class: class, failures: r.Failures, retry: Retry{Failures: r.Failures}}
	}
	return ds
}

// infraError marks the batch's database work failing (not an event's own
// failure): the batch is retried in place.
func infraError(what string, err error) error { return fmt.Errorf("%s: %w", what, err) }

// run applies one lane batch in one transaction and returns each record's
// decision once the transaction committed; an error means nothing of the
// batch happened (the database failed) and the batch must run again.
// deadline: start nothing, only park (or hand back) every record.
// pre holds records whose side effect timed out in an earlier attempt.
func (e *Engine) run(ctx context.Context, batch []*Record, deadline bool, pre map[*Record]error, pastDeadline func() bool) ([]decision, error) {
	ds := make([]decision, len(batch))
	if deadline && e.cfg.OrderedRedelivery {
		return unfinishedDecisions(batch, ClassDeadline), nil
	}
	var b batchTx
	b.claimer = e.claimer
	defer b.rollback(ctx)
	strict := e.cfg.Order == OrderStrict
	var groups []string
	seen := map[string]bool{}
	for _, r := range batch {
		if r.group != "" && !seen[r.group] {
			seen[r.group] = true
			groups = append(groups, r.group)
		}
	}
	// Every database call has HandlerTimeout: a database that hangs is a
	// failed batch (retried in place), not a stuck lane.
	tctx := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, e.cfg.HandlerTimeout) }
	if strict && !deadline {
		if err := e.preHold(tctx, batch); err != nil {
			return nil, err
		}
	}
	// After the pre-hold: a record on its last delivery is held even if
	// the charge cannot be written.
	if !deadline && len(batch) == 1 {
		if err := e.charge(ctx, batch[0]); err != nil {
			return nil, err
		}
	}
	bctx, cancel := tctx()
	if err := b.begin(bctx, e.db); err != nil {
		cancel()
		return nil, infraError("begin", err)
	}
	cancel()
	if e.fastEligible(batch, deadline, pre, pastDeadline) {
		ds, failed, err := e.runFast(ctx, &b, batch, groups, strict, pre, pastDeadline, tctx)
		switch {
		case errors.Is(err, errCareful):
			// Carefully, in the new transaction, from the first record:
			// those whose side effect failed count it without running again.
			for r, ferr := range failed {
				pre[r] = ferr
			}
			defer func() {
				for r := range failed {
					delete(pre, r) // an attempt that does not commit records nothing
				}
			}()
		case errors.Is(err, errStopAll):
			if e.cfg.OrderedRedelivery {
				return unfinishedDecisions(batch, ClassDeadline), nil
			}
			deadline = true
		case err != nil:
			return nil, err
		default:
			cctx, ccancel := tctx()
			defer ccancel()
			if err := b.commit(cctx); err != nil {
				return nil, infraError("commit", err)
			}
			return ds, nil
		}
	}
	bctx, cancel = tctx()
	// The groups' state rides in the first record's round trip, with its
	// claim when it can run: the claim is speculative and is rolled back to
	// the record's savepoint if its group turns out to be parked or held.
	first := batch[0]
	var claimFirst *Record
	if !deadline && first.decodeErr == nil && pre[first] == nil {
		claimFirst = first
	}
	st, firstClaimed, err := e.readState(bctx, &b, batch, groups, strict, claimFirst)
	cancel()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	stopped := deadline
	for i, r := range batch {
		if !stopped && i > 0 && pastDeadline != nil && pastDeadline() {
			stopped = true
		}
		rctx, rcancel := tctx()
		err := e.decide(rctx, &b, r, i == 0 && claimFirst != nil, firstClaimed, stopped, now, st, pre, &ds[i])
		rcancel()
		if err != nil {
			return nil, err
		}
	}
	cctx, ccancel := tctx()
	defer ccancel()
	if err := b.commit(cctx); err != nil {
		return nil, infraError("commit", err)
	}
	return ds, nil
}

// decide runs one record in the batch transaction and decides what becomes
// of it; an error is the batch's (infrastructure), never the record's.
// speculated: r's savepoint is set and its claim (firstClaimed) made
// already (the batch's first record).
func (e *Engine) decide(ctx context.Context, b *batchTx, r *Record, speculated, firstClaimed, stopped bool, now time.Time,
	st groupState, pre map[*Record]error, d *decision) error {
	d.failures = r.Failures
	// hasSP: r's savepoint is set. Its first write sets one (releasing the
	// previous record's), so rolling r back never reaches an earlier record.
	hasSP := speculated
	sp := func() bool { n := !hasSP; hasSP = true; return n }
	undoSpeculation := func() {
		if speculated {
			undoFresh(ctx, b)
			speculated = false
		}
	}
	grp := r.group
	// Strict order: behind a dead-lettered event of its group.
	if grp != "" {
		if head, blocked := st.holds.blocked(grp, r.key); blocked {
			// An event applied (or discarded by an operator) before is a
			// duplicate, not a later event: acknowledged, never sent to
			// the DLQ behind the hold (a replay during a hold).
			dup := false
			if r.decodeErr == nil {
				claimed := firstClaimed
				if !speculated {
					var cerr error
					if claimed, cerr = b.claim(ctx, e.cfg.Consumer, r.env); cerr != nil {
						if b.broken != nil {
							return infraError("inbox claim", cerr)
						}
						claimed = true // unknown: hold it, as before
					}
					hasSP, speculated = true, true
				}
				dup = !claimed
			}
			if !dup {
				undoSpeculation()
			}
			// r does not run: its own park (its charge) goes.
			own := false
			if p, ok := st.parks[grp]; ok && p.key == r.key {
				if err := b.exec(ctx, sp(), sqlUnpark, e.cfg.Consumer, grp, r.key); err != nil {
					return infraError("unpark", err)
				}
				delete(st.parks, grp)
				own = true
			}
			if dup {
				d.action, d.releases = ActionDuplicate, own
				return nil
			}
			if err := e.holdBehind(ctx, b, sp(), r, head, st, d); err != nil {
				return err
			}
			d.releases = own
			return nil
		}
	}
	heldHead := grp != "" && st.holds.isHead(grp, r.key)
	// Parked behind a retrying event of its group.
	p, parked := st.parks[grp]
	if parked && now.After(p.expires) {
		e.log.Warn("inbox engine: a group's retrying event did not come back in time; its later events go ahead",
			e.attrs(r, "head", p.key, "overdue", now.Sub(p.due).Round(time.Second).String())...)
		if err := b.exec(ctx, sp(), sqlUnpark, e.cfg.Consumer, grp, p.key); err != nil {
			return infraError("release an expired park", err)
		}
		delete(st.parks, grp)
		parked = false
	}
	if parked && p.key != r.key {
		undoSpeculation()
		*d = decision{action: ActionDeferred, class: ClassBlocked, failures: r.Failures, expires: p.expires,
			retry: Retry{N: p.retry, Delay: max(time.Until(p.due), 0), Failures: r.Failures, Behind: p.key}}
		return nil
	}
	parkHead := parked
	if parkHead {
		d.failures = max(d.failures, p.failures)
	}
	if stopped {
		undoSpeculation()
		if e.cfg.OrderedRedelivery {
			*d = unfinishedDecisions([]*Record{r}, ClassDeadline)[0]
			return nil
		}
		return e.deferUnstarted(ctx, b, sp(), r, st, parkHead, p, d)
	}
	if r.decodeErr != nil {
		return e.deadLetter(ctx, b, sp(), r, ClassInvalid, r.decodeErr, d.failures, parkHead, st, d)
	}
	if parkHead && r.charged && p.retry == 0 && d.failures > e.cfg.MaxRetries {
		// Its budget is spent, the last of it by attempts that ran alone
		// and never reported (the consumer died): not run again.
		undoSpeculation()
		cause := fmt.Errorf("failed, or stopped the consumer while it ran alone, %d times; not run again", d.failures)
		return e.deadLetter(ctx, b, sp(), r, ClassExhausted, cause, d.failures, parkHead, st, d)
	}
	rctx := r.env.ContextWithTrace(ctx)
	ferr := pre[r]
	if ferr == nil {
		claimed := firstClaimed
		if !speculated {
			var cerr error
			claimed, cerr = b.claim(rctx, e.cfg.Consumer, r.env)
			hasSP = true
			if cerr != nil {
				if b.broken != nil {
					return infraError("inbox claim", cerr)
				}
				ferr = cerr // PostgreSQL refused this event's claim: its own failure
			}
		}
		if ferr == nil && claimed {
			ferr = b.effect(rctx, func(ctx context.Context, tx pgx.Tx) error { return e.apply(ctx, tx, r.env) })
			if ferr != nil {
				timedOut := ctx.Err() != nil
				undoFresh(ctx, b)
				if b.broken != nil {
					if timedOut {
						pre[r] = fmt.Errorf("side effect ran out of its %s: %w", e.cfg.HandlerTimeout, ferr)
						return errRunAgain
					}
					return infraError("side effect (the transaction broke)", ferr)
				}
			}
		}
		if ferr == nil {
			if heldHead {
				if _, err := b.tx.Exec(ctx, sqlReleaseHeld, e.cfg.Consumer, grp, r.key); err != nil {
					return infraError("release held record", err)
				}
				st.holds.pop(grp)
			}
			if parkHead {
				if _, err := b.tx.Exec(ctx, sqlUnpark, e.cfg.Consumer, grp, r.key); err != nil {
					return infraError("unpark", err)
				}
				delete(st.parks, grp)
			}
			d.action = ActionApplied
			if !claimed {
				d.action = ActionDuplicate
			}
			d.releases = parkHead
			return nil
		}
	}
	// The event's own failure.
	n := d.failures + 1
	class := ClassTransient
	if envelope.IsPermanent(ferr) {
		class = ClassPermanent
	} else if n > e.cfg.MaxRetries || r.LastDelivery {
		class = ClassExhausted
	}
	if class != ClassTransient {
		cause := ferr
		if class == ClassExhausted {
			cause = fmt.Errorf("failed after %d retries: %w", n-1, ferr)
		}
		return e.deadLetter(ctx, b, sp(), r, class, cause, n, parkHead, st, d)
	}
	delay := e.delay(n)
	due := time.Now().Add(delay)
	np := park{key: r.key, failures: n, retry: n, due: due, expires: due.Add(e.cfg.ParkGrace)}
	if err := e.writePark(ctx, b, sp(), r, np, ferr.Error()); err != nil {
		return err
	}
	st.parks[grp] = np
	*d = decision{action: ActionRetry, class: ClassTransient, err: ferr, failures: n - 1, expires: np.expires,
		retry: Retry{N: n, Delay: delay, Failures: n}}
	e.log.Warn("inbox engine: event failed; retrying after a delay", e.attrs(r, "retry", n, "delay", delay.String(), "error", ferr.Error())...)
	return nil
}

// charge commits, before a redelivered record runs alone, that its attempt
// started: the record becomes its group's parked head with retry 0 (the
// group's later events wait behind it, as they must while it may still be
// running) and its failures so far. The charge goes when the attempt's
// outcome is recorded (applied, retried, dead-lettered). If the record is
// delivered again and finds its charge still there, that attempt never
// reported: the consumer died while running this record alone, and that
// counts as one of the event's failures. A crash is charged only to a
// record that ran alone, never to a batch's other records: a session runs
// a redelivered record in a batch of its own while no other batch of the
// session runs (session.go), so a crash loop, a deploy or an outage spends
// no healthy event's budget, while an event that kills the consumer each
// time is dead-lettered after MaxRetries.
func (e *Engine) charge(ctx context.Context, r *Record) error {
	if r.charged || !r.redelivered() || r.decodeErr != nil || r.group == "" {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, e.cfg.HandlerTimeout)
	defer cancel()
	err := pgx.BeginFunc(cctx, e.db, func(tx pgx.Tx) error {
		var key string
		var failures, retry int
		err := tx.QueryRow(cctx, sqlParkOf, e.cfg.Consumer, r.group).Scan(&key, &failures, &retry)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			failures = 0
		case err != nil:
			return err
		case key != r.key:
			return nil // parked behind another event: r waits, it does not run
		case retry == 0:
			failures++
			e.log.Warn("inbox engine: the consumer stopped while this event ran alone; counted as one of its failures",
				e.attrs(r, "failures", failures)...)
		}
		failures = max(failures, r.Failures)
		now := time.Now()
		_, err = tx.Exec(cctx, sqlPark, e.cfg.Consumer, r.group, r.key, nullEventID(r), nullSequence(r), failures, 0, now,
			now.Add(e.cfg.ParkGrace), "running alone after a redelivery; still here if that attempt never reported")
		return err
	})
	if err != nil {
		return infraError("charge a redelivered record", err)
	}
	r.charged = true
	return nil
}

// undoFresh rolls the running record back with a short time of its own:
// it must work even when the record's time ran out.
func undoFresh(ctx context.Context, b *batchTx) {
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	b.undo(c)
}

// preHold holds, committed at once and before the batch runs, the group of
// every record on its broker's last delivery (strict order): if the attempt
// fails the engine dead-letters the record and the hold stays; if the
// process dies, the broker gives up on the record (SQS moves it to the DLQ
// itself) and the hold still keeps the group's later events behind it. A
// record is pre-held only while every earlier record of its group in the
// batch is on its last delivery too, so a pre-hold never puts a later
// record ahead of an earlier one.
func (e *Engine) preHold(tctx func() (context.Context, context.CancelFunc), batch []*Record) error {
	var pg, pk, pe []string
	var ps []int64
	notLast := map[string]bool{}
	for _, r := range batch {
		if r.group == "" {
			continue
		}
		if !r.LastDelivery || r.decodeErr != nil {
			notLast[r.group] = true
			continue
		}
		if !notLast[r.group] {
			pg, pk, pe, ps = append(pg, r.group), append(pk, r.key), append(pe, r.env.ID), append(ps, r.env.Sequence)
		}
	}
	if len(pg) == 0 {
		return nil
	}
	ctx, cancel := tctx()
	defer cancel()
	if _, err := e.db.Exec(ctx, sqlPreHold, e.cfg.Consumer, pg, pk, pe, ps); err != nil {
		return infraError("hold groups before their last delivery", err)
	}
	return nil
}

// readState reads the groups' parks and, in strict order, whether any is
// held, in one round trip that also sets claim's savepoint and claims it
// (claim nil: no record to claim); the held rows take one more round trip,
// only when a group is held.
func (e *Engine) readState(ctx context.Context, b *batchTx, batch []*Record, groups []string, strict bool, claim *Record) (groupState, bool, error) {
	st := groupState{parks: map[string]park{}}
	if strict {
		st.holds = newHoldSet()
	}
	n := len(batch)
	q := e.stateQuery(batch, groups, strict)
	pb := &pgx.Batch{}
	if claim != nil {
		b.n++
		b.current = fmt.Sprintf("fifobox_record_%d", b.n)
		pb.Queue("SAVEPOINT " + b.current)
	}
	if q != "" {
		pb.Queue(q, e.cfg.Consumer, groups)
	}
	if claim != nil {
		q := e.claimer.query(e.cfg.Consumer, claim.env)
		pb.Queue(q.SQL, q.Arguments...)
	}
	if pb.Len() == 0 {
		return st, false, nil
	}
	br := b.tx.SendBatch(ctx, pb)
	held, claimed, err := func() (held, claimed bool, err error) {
		if claim != nil {
			if _, err := br.Exec(); err != nil {
				return false, false, err
			}
		}
		if held, err = readGroupState(br, q, st.parks); err != nil {
			return false, false, err
		}
		if claim != nil {
			tag, err := br.Exec()
			if err != nil {
				return false, false, err
			}
			claimed = tag.RowsAffected() == 1
		}
		return held, claimed, nil
	}()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		b.broken = err
		return st, false, infraError("read the groups' parks and holds", err)
	}
	if held {
		hb := &pgx.Batch{}
		limit := n + 1 // a batch of n records can release at most n rows
		hb.Queue(sqlLoadHolds, e.cfg.Consumer, groups, limit)
		hbr := b.tx.SendBatch(ctx, hb)
		hs, err := scanHolds(hbr, limit)
		if cerr := hbr.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			b.broken = err
			return st, false, infraError("read held groups", err)
		}
		st.holds = hs
	}
	return st, claimed, nil
}

// stateQuery is the statement reading the batch's groups' state: their
// parks, whether any is held (strict order), both, or nothing ("").
func (e *Engine) stateQuery(batch []*Record, groups []string, strict bool) string {
	// A broker that keeps a group's later messages back while one is
	// retried (SQS FIFO) cannot deliver a first delivery behind a parked
	// head: a batch of first deliveries needs no parks (only a retried
	// message reads its own failure count).
	needParks := !e.cfg.OrderedRedelivery
	for _, r := range batch {
		needParks = needParks || r.Deliveries != 1
	}
	switch {
	case len(groups) == 0:
		return ""
	case needParks && strict:
		return sqlParksAndHeld
	case needParks:
		return sqlParks
	case strict:
		return sqlAnyHeld
	}
	return ""
}

// readGroupState reads the result of stateQuery q, the next in br, into
// parks and reports whether any group is held.
func readGroupState(br pgx.BatchResults, q string, parks map[string]park) (held bool, err error) {
	switch q {
	case sqlAnyHeld:
		if err := br.QueryRow().Scan(&held); err != nil {
			return false, err
		}
	case sqlParks, sqlParksAndHeld:
		rows, err := br.Query()
		if err != nil {
			return false, err
		}
		for rows.Next() {
			var g string
			var p park
			var isHeld bool
			if err := rows.Scan(&isHeld, &g, &p.key, &p.failures, &p.retry, &p.due, &p.expires); err != nil {
				rows.Close()
				return false, err
			}
			if isHeld {
				held = true
			} else {
				parks[g] = p
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return false, err
		}
	}
	return held, nil
}

// writePark parks r's group with np as its head, under r's savepoint.
func (e *Engine) writePark(ctx context.Context, b *batchTx, newRecord bool, r *Record, np park, lastError string) error {
	if len(lastError) > 1000 {
		lastError = lastError[:1000]
	}
	err := b.exec(ctx, newRecord, sqlPark, e.cfg.Consumer, r.group, r.key, nullEventID(r), nullSequence(r),
		np.failures, np.retry, np.due, np.expires, lastError)
	if err != nil {
		return infraError("park the group", err)
	}
	return nil
}

// holdBehind lists r behind its group's first held row (strict order) and
// decides it goes to the dead-letter queue, naming what it waits for.
func (e *Engine) holdBehind(ctx context.Context, b *batchTx, newRecord bool, r *Record, head heldRow, st groupState, d *decision) error {
	if err := b.exec(ctx, newRecord, sqlHold, e.cfg.Consumer, r.group, r.key, nullEventID(r), nullSequence(r), ClassHeld); err != nil {
		return infraError("hold record", err)
	}
	st.holds.add(r.group, heldRow{key: r.key, eventID: r.env.ID, seq: r.env.Sequence, class: ClassHeld})
	waits := "an invalid message (" + head.key + ")"
	if head.eventID != "" {
		waits = fmt.Sprintf("event %s (sequence %d)", head.eventID, head.seq)
	}
	reason := fmt.Sprintf("held: waits for %s, which this consumer dead-lettered (%s); redrive the DLQ to apply the group in order", waits, head.class)
	*d = decision{action: ActionHeld, class: ClassHeld, failures: r.Failures, dead: DeadLetter{Class: ClassHeld, Reason: reason, Failures: r.Failures},
		err: errors.New(reason)}
	e.log.Info("inbox engine: event held behind a dead-lettered one", e.attrs(r, "waits_for", waits)...)
	return nil
}

// deadLetter decides r goes to the dead-letter queue. In strict order its
// group is held first (r becomes, or stays, its first held row); r's park,
// if it was the head, goes.
func (e *Engine) deadLetter(ctx context.Context, b *batchTx, newRecord bool, r *Record, class string, cause error, failures int, parkHead bool, st groupState, d *decision) error {
	if r.group != "" && (st.holds != nil || parkHead) {
		var qs []*pgx.QueuedQuery
		if st.holds != nil {
			qs = append(qs, &pgx.QueuedQuery{SQL: sqlHold, Arguments: []any{e.cfg.Consumer, r.group, r.key, nullEventID(r), nullSequence(r), class}})
		}
		if parkHead {
			qs = append(qs, &pgx.QueuedQuery{SQL: sqlUnpark, Arguments: []any{e.cfg.Consumer, r.group, r.key}})
		}
		if _, err := b.run(ctx, newRecord, qs...); err != nil {
			return infraError("hold the group", err)
		}
		if st.holds != nil {
			st.holds.add(r.group, heldRow{key: r.key, eventID: r.env.ID, seq: r.env.Sequence, class: class})
		}
		delete(st.parks, r.group)
	}
	reason := cause.Error()
	if len(reason) > 1000 {
		reason = reason[:1000]
	}
	*d = decision{action: ActionDeadLetter, class: class, err: cause, failures: failures - boolInt(class != ClassInvalid),
		dead: DeadLetter{Class: class, Reason: reason, Failures: failures}, releases: parkHead}
	e.log.Error("inbox engine: event sent to the dead-letter queue", e.attrs(r, "class", class, "reason", reason, "order", e.cfg.Order.String())...)
	return nil
}

// deferUnstarted decides what happens to a record not started before the
// deadline: strict order's holds still apply (a write, no side effect);
// otherwise it goes back to the broker behind nothing newer of its group,
// its group parked with it as the head unless a head is parked already,
// and no failure counted.
func (e *Engine) deferUnstarted(ctx context.Context, b *batchTx, newRecord bool, r *Record, st groupState, parkHead bool, p park, d *decision) error {
	if r.decodeErr != nil {
		// Invalid records run no side effect: dead-lettered now.
		return e.deadLetter(ctx, b, newRecord, r, ClassInvalid, r.decodeErr, d.failures, parkHead, st, d)
	}
	n, failures := 1, d.failures
	if parkHead {
		n = max(p.retry, 1)
	}
	delay := e.delay(n)
	due := time.Now().Add(delay)
	np := park{key: r.key, failures: failures, retry: n, due: due, expires: due.Add(e.cfg.ParkGrace)}
	if err := e.writePark(ctx, b, newRecord, r, np, "not started before the invocation's deadline"); err != nil {
		return err
	}
	st.parks[r.group] = np
	*d = decision{action: ActionDeferred, class: ClassDeadline, failures: failures, expires: np.expires,
		retry: Retry{N: n, Delay: delay, Failures: failures}}
	return nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func nullEventID(r *Record) any {
	if r.decodeErr != nil {
		return nil
	}
	return r.env.ID
}

func nullSequence(r *Record) any {
	if r.decodeErr != nil || r.env.Sequence == 0 {
		return nil
	}
	return r.env.Sequence
}
