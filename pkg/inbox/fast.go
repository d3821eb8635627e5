package inbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// The fast way through a batch (runFast), taken when nothing in it needs
// per-record bookkeeping: every record a valid first delivery, none on its
// last delivery, no earlier attempt to account for. One round trip reads
// the groups' state and claims every record in one statement; the side
// effects then run one after the other with no savepoint between them.
// Anything else (a group parked or held, a refused claim, a side effect
// failing) rolls the transaction back and the batch goes the careful way
// (a savepoint per record) from its first record, with the failed record's
// failure carried over, not run again. Neither way commits a claim without
// its side effect, nor applies a record before an earlier one of its group.
var (
	// errCareful: run the batch the careful way, in the new transaction.
	errCareful = errors.New("inbox engine: the batch goes the careful way")
	// errStopAll: past the deadline with nothing of the batch kept; every
	// record is handed back unstarted.
	errStopAll = errors.New("inbox engine: deadline reached and the batch's claims could not be undone")
)

// fastEligible reports whether batch may try the fast way.
func (e *Engine) fastEligible(batch []*Record, deadline bool, pre map[*Record]error, pastDeadline func() bool) bool {
	// Stopping at a deadline mid-batch deletes the claims of the records
	// not started; where that was refused once, batches with a deadline go
	// the careful way.
	if deadline || len(pre) > 0 || (pastDeadline != nil && e.noUnclaim.Load()) {
		return false
	}
	ids := make(map[string]string, len(batch))
	for _, r := range batch {
		if r.decodeErr != nil || r.group == "" || r.redelivered() || r.LastDelivery {
			return false
		}
		// The claim returns the ids it inserted, in the column's spelling
		// (a uuid column: lower case): two spellings of one id in a batch
		// could not be told apart.
		k := strings.ToLower(r.env.ID)
		if id, ok := ids[k]; ok && id != r.env.ID {
			return false
		}
		ids[k] = r.env.ID
	}
	return true
}

// runFast applies batch the fast way in b's transaction and returns each
// record's decision; the caller commits. errCareful (with the records whose
// side effect failed) and errStopAll come back with b in a new transaction.
func (e *Engine) runFast(ctx context.Context, b *batchTx, batch []*Record, groups []string, strict bool, pre map[*Record]error,
	pastDeadline func() bool, tctx func() (context.Context, context.CancelFunc)) ([]decision, map[*Record]error, error) {
	restart := func(then error, failed map[*Record]error) ([]decision, map[*Record]error, error) {
		c, cancel := tctx()
		defer cancel()
		if err := b.restart(c, e.db); err != nil {
			return nil, nil, infraError("begin", err)
		}
		return nil, failed, then
	}
	es := make([]envelope.Envelope, len(batch))
	for i, r := range batch {
		es[i] = r.env
	}
	st := groupState{parks: map[string]park{}}
	if strict {
		st.holds = newHoldSet()
	}
	q := e.stateQuery(batch, groups, strict)
	pb := &pgx.Batch{}
	if q != "" {
		pb.Queue(q, e.cfg.Consumer, groups)
	}
	cq := e.claimer.bulkQuery(e.cfg.Consumer, es)
	pb.Queue(cq.SQL, cq.Arguments...)
	bctx, cancel := tctx()
	br := b.tx.SendBatch(bctx, pb)
	held, err := readGroupState(br, q, st.parks)
	var inserted []string
	if err == nil {
		var rows pgx.Rows
		if rows, err = br.Query(); err == nil {
			for rows.Next() {
				var id string
				if err = rows.Scan(&id); err != nil {
					break
				}
				inserted = append(inserted, id)
			}
			rows.Close()
			if err == nil {
				err = rows.Err()
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	cancel()
	if err != nil {
		// A claim PostgreSQL refused is that record's own failure, which
		// the careful way tells apart; a database that is gone fails the
		// new transaction's begin.
		return restart(errCareful, nil)
	}
	if held || len(st.parks) > 0 {
		return restart(errCareful, nil)
	}
	claimed, err := matchClaims(batch, inserted)
	if err != nil {
		e.log.Error("inbox engine: the batch's claim returned ids it was not given; going the careful way", "consumer", e.cfg.Consumer, "error", err.Error())
		return restart(errCareful, nil)
	}
	ds := make([]decision, len(batch))
	stop := len(batch)
	for i, r := range batch {
		if i > 0 && pastDeadline != nil && pastDeadline() {
			stop = i
			break
		}
		ds[i] = decision{action: ActionDuplicate, failures: r.Failures}
		if !claimed[i] {
			continue
		}
		rctx, rcancel := tctx()
		ferr := b.effect(r.env.ContextWithTrace(rctx), func(ctx context.Context, tx pgx.Tx) error { return e.apply(ctx, tx, r.env) })
		timedOut := rctx.Err() != nil
		rcancel()
		if ferr == nil {
			ds[i].action = ActionApplied
			continue
		}
		conn := b.tx.Conn()
		if !conn.IsClosed() && conn.PgConn().TxStatus() == 'I' {
			// The side effect ended the transaction in SQL (COMMIT,
			// ROLLBACK): if it committed, the claims of the records after
			// it did too, and go now. The batch runs again, as when the
			// careful way finds its transaction ended.
			e.unclaimEnded(ctx, batch[i+1:], claimed[i+1:])
			return nil, nil, infraError("side effect (it ended the transaction)", ferr)
		}
		c, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		rerr := b.tx.Rollback(c)
		ccancel()
		b.tx = nil
		if rerr != nil || conn.IsClosed() {
			if timedOut {
				pre[r] = fmt.Errorf("side effect ran out of its %s: %w", e.cfg.HandlerTimeout, ferr)
				return nil, nil, errRunAgain
			}
			return nil, nil, infraError("side effect (the transaction broke)", ferr)
		}
		return restart(errCareful, map[*Record]error{r: ferr})
	}
	if stop == len(batch) {
		return ds, nil, nil
	}
	// The deadline: the records not started lose their claims and are
	// handed back (or parked) as the careful way does.
	ub := &pgx.Batch{}
	for i := stop; i < len(batch); i++ {
		if claimed[i] {
			q := e.claimer.unclaimQuery(e.cfg.Consumer, batch[i].env)
			ub.Queue(q.SQL, q.Arguments...)
		}
	}
	if ub.Len() > 0 {
		uctx, ucancel := tctx()
		ubr := b.tx.SendBatch(uctx, ub)
		var err error
		for i := 0; i < ub.Len() && err == nil; i++ {
			var tag pgconn.CommandTag
			if tag, err = ubr.Exec(); err == nil && tag.RowsAffected() != 1 {
				err = fmt.Errorf("deleted %d rows for one claim", tag.RowsAffected())
			}
		}
		if cerr := ubr.Close(); err == nil {
			err = cerr
		}
		ucancel()
		if err != nil {
			e.noUnclaim.Store(true)
			e.log.Warn("inbox engine: could not undo the claims of records not started before the deadline; this batch is handed back whole, and batches with a deadline go the careful way from now on",
				"consumer", e.cfg.Consumer, "error", err.Error())
			return restart(errStopAll, nil)
		}
	}
	now := time.Now()
	for i := stop; i < len(batch); i++ {
		rctx, rcancel := tctx()
		err := e.decide(rctx, b, batch[i], false, false, true, now, st, pre, &ds[i])
		rcancel()
		if err != nil {
			return nil, nil, err
		}
	}
	return ds, nil, nil
}

// matchClaims tells which records the batch's claim inserted, from the
// event ids it returned: of several records of one event, the first.
func matchClaims(batch []*Record, inserted []string) ([]bool, error) {
	first := make(map[string]int, len(batch))
	for i := len(batch) - 1; i >= 0; i-- {
		first[strings.ToLower(batch[i].env.ID)] = i
	}
	claimed := make([]bool, len(batch))
	for _, id := range inserted {
		i, ok := first[strings.ToLower(id)]
		if !ok || claimed[i] {
			return nil, fmt.Errorf("event id %q: not in the batch, or returned twice", id)
		}
		claimed[i] = true
	}
	return claimed, nil
}

// unclaimEnded deletes, outside any transaction, the claims of records that
// did not run because a side effect before them ended the transaction (if
// it rolled back, there is nothing to delete).
func (e *Engine) unclaimEnded(ctx context.Context, rest []*Record, claimed []bool) {
	ub := &pgx.Batch{}
	for i, r := range rest {
		if claimed[i] {
			q := e.claimer.unclaimQuery(e.cfg.Consumer, r.env)
			ub.Queue(q.SQL, q.Arguments...)
		}
	}
	if ub.Len() == 0 {
		return
	}
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.HandlerTimeout)
	defer cancel()
	if err := e.db.SendBatch(c, ub).Close(); err != nil {
		e.log.Error("inbox engine: a side effect ended the inbox transaction and the claims of the events after it could not be deleted; if it committed, those events are recorded as applied without their side effect",
			"consumer", e.cfg.Consumer, "error", err.Error())
	}
}
