package redrive

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

type replayEvent struct {
	id                          int64
	eventID, eventType, aggType string
	aggID, tenant, traceparent  string
	seq                         int64
}

func (e replayEvent) attrs() map[string]string {
	return envelope.Envelope{Type: e.eventType, AggregateType: e.aggType, TenantID: e.tenant, TraceParent: e.traceparent}.Attributes()
}

// replay re-sends sent events to one consumer's queue. The inbox rows of the
// selected events are deleted in the transaction that writes the audit row;
// then the events go out through the transport's Operations.Replay in
// (aggregate, sequence) order, with the stored body and attributes and
// deduplication ids unique to this replay (the original event id may still
// be in the broker's deduplication window). Events the consumer would not
// have received (its filter, bindings or filter subjects) are skipped.
func (s *Service) replay(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	ops, err := s.ops(cmd.Consumer)
	if err != nil {
		return res, fmt.Errorf("replay: %w", err)
	}
	ids, since, until, err := selection(cmd, true)
	if err != nil {
		return res, fmt.Errorf("replay: %w", err)
	}
	if since == nil {
		return res, fmt.Errorf("replay: %w", fieldErr("since", "required (replaying a whole history must be explicit: pass 1970-01-01)"))
	}
	rows, err := s.db.Query(ctx, sqlReplayEvents, ids, cmd.AggregateType, since, until)
	if err != nil {
		return res, fmt.Errorf("replay: select events: %w", err)
	}
	evs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (replayEvent, error) {
		var e replayEvent
		err := r.Scan(&e.id, &e.eventID, &e.eventType, &e.aggType, &e.aggID, &e.seq, &e.tenant, &e.traceparent)
		return e, err
	})
	if err != nil {
		return res, fmt.Errorf("replay: select events: %w", err)
	}
	kept := evs[:0]
	for _, e := range evs {
		yes, err := ops.Selects(cmd.Consumer, e.message(nil))
		if err != nil {
			return res, fmt.Errorf("replay: %w", err)
		}
		if yes {
			kept = append(kept, e)
		}
	}
	evs = kept
	if len(evs) > cmd.Max {
		return res, fmt.Errorf("replay: %w", fieldErr("max", "%d events selected, more than %d: narrow the time range or raise it", len(evs), cmd.Max))
	}
	aggs := map[string]bool{}
	for _, e := range evs {
		aggs[e.aggID] = true
	}
	res.Affected, res.Aggregates = int64(len(evs)), len(aggs)
	if cmd.DryRun {
		res.Message = fmt.Sprintf("would replay %d events of %d aggregates to %s", len(evs), len(aggs), cmd.Consumer)
		return res, nil
	}
	if len(evs) == 0 {
		res.Message = "no sent events match"
	}

	eventIDs := make([]string, len(evs))
	for i, e := range evs {
		eventIDs[i] = e.eventID
	}
	var auditID int64
	var deleted int64
	err = pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		if auditID, err = s.auditStart(ctx, tx, cmd); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, sqlForgetInbox, cmd.Consumer, eventIDs)
		if err != nil {
			return fmt.Errorf("delete inbox entries: %w", err)
		}
		deleted = tag.RowsAffected()
		return nil
	})
	if err != nil {
		return res, fmt.Errorf("replay: %w", err)
	}
	res.AuditID = auditID
	s.log.Info("replay: inbox entries deleted", "audit_id", auditID, "consumer", cmd.Consumer, "deleted", deleted, "events", len(evs))

	var sent int64
	sendErr := func() error {
		for start := 0; start < len(evs); start += replayChunk {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("stopped after %d of %d events: %w", sent, len(evs), err)
			}
			chunk := evs[start:min(start+replayChunk, len(evs))]
			if err := s.replayChunk(ctx, ops, cmd.Consumer, chunk); err != nil {
				return fmt.Errorf("after %d of %d events: %w", sent, len(evs), err)
			}
			sent += int64(len(chunk))
			s.progress(cmd.Operation, sent, int64(len(evs)))
		}
		return nil
	}()
	res.Affected = sent
	if err := s.auditFinish(ctx, auditID, cmd, sent, sendErr); err != nil && sendErr == nil {
		sendErr = err
	}
	if sendErr != nil {
		return res, fmt.Errorf("replay: %w (inbox entries of unsent events are deleted already: run the same replay again)", sendErr)
	}
	if res.Message == "" {
		res.Message = fmt.Sprintf("replayed %d events of %d aggregates to %s (%d inbox entries cleared)", sent, len(aggs), cmd.Consumer, deleted)
	}
	return res, nil
}

// message is e as the transport sends it, with body.
func (e replayEvent) message(body []byte) outbox.Message {
	return outbox.Message{ID: e.id, EventID: e.eventID, GroupID: e.aggID, AggregateType: e.aggType,
		Sequence: e.seq, EventType: e.eventType, Body: body, Attributes: e.attrs(), Attempt: 1}
}

// replayChunk sends one chunk through the transport, in order.
func (s *Service) replayChunk(ctx context.Context, ops transport.Operations, consumer string, chunk []replayEvent) error {
	bodies, err := s.bodies(ctx, chunk)
	if err != nil {
		return err
	}
	msgs := make([]outbox.Message, len(chunk))
	for i, e := range chunk {
		msgs[i] = e.message(bodies[e.id])
	}
	sent, err := ops.Replay(ctx, consumer, msgs)
	if err == nil && sent != len(msgs) {
		err = fmt.Errorf("the transport took %d of %d events", sent, len(msgs))
	}
	return err
}

// bodies reads the stored bodies of chunk's events; a pruned one is an error.
func (s *Service) bodies(ctx context.Context, chunk []replayEvent) (map[int64][]byte, error) {
	ids := make([]int64, len(chunk))
	for i, e := range chunk {
		ids[i] = e.id
	}
	rows, err := s.db.Query(ctx, sqlBodies, ids)
	if err != nil {
		return nil, fmt.Errorf("read bodies: %w", err)
	}
	defer rows.Close()
	bodies := map[int64][]byte{}
	for rows.Next() {
		var id int64
		var b []byte
		if err := rows.Scan(&id, &b); err != nil {
			return nil, fmt.Errorf("read bodies: %w", err)
		}
		bodies[id] = b
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read bodies: %w", err)
	}
	for _, e := range chunk {
		if _, ok := bodies[e.id]; !ok {
			return nil, fmt.Errorf("event %s was pruned while replaying", e.eventID)
		}
	}
	return bodies, nil
}
