package redrive

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
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
// then the events go out in (aggregate, sequence) order with SendMessageBatch,
// MessageGroupId = aggregate id, the stored body, the SNS message attributes,
// and a deduplication id unique to this replay (the original event id may
// still be in the queue's 5-minute deduplication window).
func (s *Service) replay(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	q, err := s.queues(cmd.Consumer)
	if err != nil {
		return res, fmt.Errorf("replay: %w", err)
	}
	if len(cmd.EventIDs) > 0 {
		return res, errors.New("replay: select by aggregate_type and since/until, not event_ids")
	}
	ids, since, until, err := selection(cmd, true)
	if err != nil {
		return res, fmt.Errorf("replay: %w", err)
	}
	if since == nil {
		return res, errors.New("replay: since is required (replaying a whole history must be explicit: pass the epoch)")
	}
	filter, known := s.cfg.Topology.Consumer(cmd.Consumer)

	rows, err := s.db.Query(ctx, `SELECT id, event_id::text, event_type, aggregate_type, aggregate_id, aggregate_seq,
       coalesce(tenant_id, ''), coalesce(traceparent, '')
FROM outbox WHERE state = 'sent'`+sqlSelectWhere+`
ORDER BY aggregate_id, aggregate_seq`, ids, cmd.AggregateType, since, until)
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
	switch sel, ok := s.cfg.Broker.(brokerSelector); {
	case s.cfg.Broker != nil && ok:
		// The broker's bindings decide, not SNS's filter policies.
		kept := evs[:0]
		for _, e := range evs {
			yes, err := sel.Selects(cmd.Consumer, outbox.Message{EventID: e.eventID, GroupID: e.aggID, AggregateType: e.aggType,
				EventType: e.eventType, Sequence: e.seq, Attributes: e.attrs()})
			if err != nil {
				return res, fmt.Errorf("replay: %w", err)
			}
			if yes {
				kept = append(kept, e)
			}
		}
		evs = kept
	case s.cfg.Broker == nil && known:
		evs = matching(evs, filter)
	}
	if len(evs) > cmd.Max {
		return res, fmt.Errorf("replay: %d events selected, more than max %d: narrow the time range or raise max", len(evs), cmd.Max)
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
		tag, err := tx.Exec(ctx, `DELETE FROM inbox WHERE consumer = $1 AND event_id = ANY($2::uuid[])`, cmd.Consumer, eventIDs)
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
		for start := 0; start < len(evs); start += sqsBatchSize {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("stopped after %d of %d events: %w", sent, len(evs), err)
			}
			chunk := evs[start:min(start+sqsBatchSize, len(evs))]
			send := func() error { return s.sendChunk(ctx, q.QueueURL, auditID, chunk) }
			if s.cfg.Broker != nil {
				send = func() error { return s.brokerChunk(ctx, cmd.Consumer, chunk) }
			}
			if err := send(); err != nil {
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

// brokerSelector is a broker that can say which events a consumer's queue
// receives (pkg/transport/amqp.Operations: its bindings).
type brokerSelector interface {
	Selects(consumer string, m outbox.Message) (bool, error)
}

func matching(evs []replayEvent, c topology.Consumer) []replayEvent {
	out := evs[:0]
	for _, e := range evs {
		if c.Matches(e.attrs()) {
			out = append(out, e)
		}
	}
	return out
}

// brokerChunk replays one chunk through another transport's broker
// (Config.Broker), in order.
func (s *Service) brokerChunk(ctx context.Context, consumer string, chunk []replayEvent) error {
	bodies, err := s.bodies(ctx, chunk)
	if err != nil {
		return err
	}
	msgs := make([]outbox.Message, len(chunk))
	for i, e := range chunk {
		msgs[i] = outbox.Message{ID: e.id, EventID: e.eventID, GroupID: e.aggID, AggregateType: e.aggType,
			Sequence: e.seq, EventType: e.eventType, Body: bodies[e.id], Attributes: e.attrs(), Attempt: 1}
	}
	sent, err := s.cfg.Broker.Replay(ctx, consumer, msgs)
	if err == nil && sent != len(msgs) {
		err = fmt.Errorf("broker took %d of %d events", sent, len(msgs))
	}
	return err
}

// bodies reads the stored bodies of chunk's events; a pruned one is an error.
func (s *Service) bodies(ctx context.Context, chunk []replayEvent) (map[int64][]byte, error) {
	ids := make([]int64, len(chunk))
	for i, e := range chunk {
		ids[i] = e.id
	}
	rows, err := s.db.Query(ctx, `SELECT id, body FROM outbox WHERE id = ANY($1)`, ids)
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

// sendChunk sends one batch in order; any failed entry fails the chunk (the
// entries after it in the same group must not overtake it).
func (s *Service) sendChunk(ctx context.Context, queueURL string, auditID int64, chunk []replayEvent) error {
	bodies, err := s.bodies(ctx, chunk)
	if err != nil {
		return err
	}
	entries := make([]sqstypes.SendMessageBatchRequestEntry, len(chunk))
	for i, e := range chunk {
		b := bodies[e.id]
		attrs := map[string]sqstypes.MessageAttributeValue{}
		for k, v := range e.attrs() {
			attrs[k] = sqstypes.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
		}
		entries[i] = sqstypes.SendMessageBatchRequestEntry{
			Id:                     aws.String(fmt.Sprintf("e%d", i)),
			MessageBody:            aws.String(string(b)),
			MessageGroupId:         aws.String(e.aggID),
			MessageDeduplicationId: aws.String(fmt.Sprintf("replay-%d-%s", auditID, e.eventID)),
			MessageAttributes:      attrs,
		}
	}
	return sendBatch(ctx, s.sqs, queueURL, entries)
}

func sendBatch(ctx context.Context, api SQSAPI, queueURL string, entries []sqstypes.SendMessageBatchRequestEntry) error {
	out, err := api.SendMessageBatch(ctx, &sqs.SendMessageBatchInput{QueueUrl: aws.String(queueURL), Entries: entries})
	if err != nil {
		return fmt.Errorf("send message batch: %w", err)
	}
	if len(out.Failed) > 0 {
		var msgs []string
		for _, f := range out.Failed {
			msgs = append(msgs, aws.ToString(f.Id)+": "+aws.ToString(f.Code)+" "+aws.ToString(f.Message))
		}
		return fmt.Errorf("send message batch: %d of %d entries failed: %s", len(out.Failed), len(entries), strings.Join(msgs, "; "))
	}
	return nil
}
