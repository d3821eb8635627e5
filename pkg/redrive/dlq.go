package redrive

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// DLQListing is what dlq-list and dlq-peek saw of a dead-letter queue.
type DLQListing struct {
	Consumer string `json:"consumer"`
	From     string `json:"from"`
	// Total is about how many messages the queue holds (-1 unknown).
	Total int64 `json:"total"`
	// Complete is true when every message of the queue was looked at.
	Complete bool                   `json:"complete"`
	Messages []transport.DLQMessage `json:"messages"`
	// Held are the consumer's groups held in strict order, each with the
	// messages listed behind its dead one (from the database: complete even
	// where the broker shows only each group's first message).
	Held []HeldGroup `json:"held,omitempty"`
	// Missing are requested messages that were not found.
	Missing []string `json:"missing,omitempty"`
}

// HeldGroup is one group a strict-order consumer holds.
type HeldGroup struct {
	Group    string        `json:"group"`
	Messages []HeldMessage `json:"messages"`
	// More counts further messages not listed.
	More int64 `json:"more,omitempty"`
}

// HeldMessage is one inbox_held row: a message of a held group, in order.
type HeldMessage struct {
	Key      string    `json:"key"`
	Sequence int64     `json:"sequence,omitempty"`
	Class    string    `json:"class"`
	HeldAt   time.Time `json:"held_at"`
}

// heldShown bounds the rows dlq-list shows per held group.
const heldShown = 20

func (c Command) selection() transport.DLQSelection {
	return transport.DLQSelection{Consumer: c.Consumer, From: transport.DLQ(c.From), Groups: c.Groups, Aggregates: c.Aggregates, Keys: c.Messages}
}

func (c Command) fromText() string {
	if c.From == SourceSubscriptionDLQ {
		return "the subscription DLQ"
	}
	return "the DLQ"
}

// dlqRedrive moves up to Max messages (all, or the chosen groups') from the
// consumer's DLQ (or, on SNS, its subscription's DLQ) back to its queue
// through the transport's Operations, which keeps each group's order; the
// audit row brackets the move. A crash midway may deliver a message twice:
// the consumer's inbox drops the copy.
func (s *Service) dlqRedrive(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	ops, err := s.ops(cmd.Consumer)
	if err != nil {
		return res, fmt.Errorf("redrive: %w", err)
	}
	req := transport.RedriveRequest{Consumer: cmd.Consumer, From: transport.DLQ(cmd.From), Max: cmd.Max, DryRun: cmd.DryRun,
		Groups: cmd.Groups, Aggregates: cmd.Aggregates,
		Progress: func(moved, total int64) { s.progress(cmd.Operation, moved, total) }}
	which := "messages"
	if len(cmd.Groups)+len(cmd.Aggregates) > 0 {
		which = "messages of the chosen groups"
	}
	if cmd.DryRun {
		r, err := ops.Redrive(ctx, req)
		if err != nil {
			return res, fmt.Errorf("redrive: %w", err)
		}
		res.Affected = int64(r.Moved)
		exact := r.Complete
		res.Exact = &exact
		res.Message = fmt.Sprintf("would move %d %s from %s of %s", r.Moved, which, cmd.fromText(), cmd.Consumer)
		switch {
		case !exact && r.InFlight > 0:
			res.Message += fmt.Sprintf(" (%d more are in flight, received by someone else: they move too if they come back while the redrive runs)", r.InFlight)
		case !exact:
			res.Message += " (at least: SQS shows a group's later messages only once the ones before it are gone)"
		}
		return res, nil
	}
	auditID, err := s.auditStart(ctx, s.db, cmd)
	if err != nil {
		return res, err
	}
	res.AuditID = auditID
	r, opErr := ops.Redrive(ctx, req)
	res.Affected = int64(r.Moved)
	if err := s.auditFinish(ctx, auditID, cmd, res.Affected, opErr); err != nil && opErr == nil {
		opErr = err
	}
	if opErr != nil {
		return res, fmt.Errorf("redrive: after %d messages: %w", r.Moved, opErr)
	}
	res.Message = fmt.Sprintf("moved %d %s from %s of %s back to its queue", r.Moved, which, cmd.fromText(), cmd.Consumer)
	if r.Left > 0 {
		res.Message += fmt.Sprintf("; %d dead-lettered again during the redrive stay for the next one", r.Left)
	}
	return res, nil
}

// dlqList lists the DLQ's messages without taking them, and the consumer's
// held groups.
func (s *Service) dlqList(ctx context.Context, cmd Command) (Result, error) {
	return s.look(ctx, cmd, false)
}

// dlqPeek shows chosen messages with their bodies; audited, since it shows
// payloads.
func (s *Service) dlqPeek(ctx context.Context, cmd Command) (Result, error) {
	id, err := s.auditStart(ctx, s.db, cmd)
	if err != nil {
		return Result{Operation: cmd.Operation}, err
	}
	res, err := s.look(ctx, cmd, true)
	res.AuditID = id
	if ferr := s.auditFinish(ctx, id, cmd, res.Affected, err); err == nil {
		err = ferr
	}
	return res, err
}

func (s *Service) look(ctx context.Context, cmd Command, bodies bool) (Result, error) {
	res := Result{Operation: cmd.Operation}
	ops, err := s.ops(cmd.Consumer)
	if err != nil {
		return res, fmt.Errorf("%s: %w", cmd.Operation, err)
	}
	limit := cmd.Limit
	if limit == 0 {
		limit = defaultLimit
	}
	p, err := ops.Peek(ctx, transport.PeekRequest{DLQSelection: cmd.selection(), Limit: limit, Bodies: bodies})
	if err != nil {
		return res, fmt.Errorf("%s: %w", cmd.Operation, err)
	}
	l := &DLQListing{Consumer: cmd.Consumer, From: SourceDLQ, Total: p.Total, Complete: p.Complete, Messages: p.Messages}
	if cmd.From != "" {
		l.From = cmd.From
	}
	if l.Messages == nil {
		l.Messages = []transport.DLQMessage{}
	}
	found := map[string]bool{}
	for _, m := range p.Messages {
		found[m.Key], found[m.ID] = true, true
	}
	for _, k := range cmd.Messages {
		if !found[k] {
			l.Missing = append(l.Missing, k)
		}
	}
	if cmd.From != SourceSubscriptionDLQ {
		if l.Held, err = s.heldGroups(ctx, cmd.Consumer, cmd.Groups); err != nil {
			return res, fmt.Errorf("%s: %w", cmd.Operation, err)
		}
	}
	res.DLQ, res.Affected = l, int64(len(l.Messages))
	exact := p.Complete
	res.Exact = &exact
	if len(l.Missing) > 0 {
		return res, fmt.Errorf("%s: %w", cmd.Operation, fieldErr("messages", "not found in %s of %s: %s (on SNS/SQS a message behind its group's first one is shown only once the ones before it are gone)",
			cmd.fromText(), cmd.Consumer, strings.Join(l.Missing, ", ")))
	}
	return res, nil
}

// heldGroups reads the consumer's held groups (all, or the chosen ones),
// their first rows in order.
func (s *Service) heldGroups(ctx context.Context, consumer string, groups []string) ([]HeldGroup, error) {
	if groups == nil {
		groups = []string{}
	}
	rows, err := s.db.Query(ctx, sqlHeldGroups, consumer, groups, heldShown)
	if err != nil {
		return nil, fmt.Errorf("held groups: %w", err)
	}
	defer rows.Close()
	var out []HeldGroup
	for rows.Next() {
		var g string
		var m HeldMessage
		var n int64
		if err := rows.Scan(&g, &m.Key, &m.Sequence, &m.Class, &m.HeldAt, &n); err != nil {
			return nil, fmt.Errorf("held groups: %w", err)
		}
		if len(out) == 0 || out[len(out)-1].Group != g {
			out = append(out, HeldGroup{Group: g, More: max(0, n-heldShown)})
		}
		out[len(out)-1].Messages = append(out[len(out)-1].Messages, m)
	}
	return out, rows.Err()
}

// dlqDiscard deletes the chosen messages from the DLQ for good, then, in
// one transaction, marks their events handled for the consumer (an inbox
// row with outcome 'discarded': a later replay or copy of them is a
// duplicate, never applied) and ends their part in strict order's holds:
// the discarded messages' inbox_held rows go (for a discarded group, all
// of the group's rows), so the group's remaining messages apply in order
// when redriven, the next one first. The DLQ's messages are deleted before
// the rows: a crash in between leaves the group held behind a message that
// is gone (status shows it; release-holds ends it), never a later event
// applied before an earlier one.
func (s *Service) dlqDiscard(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	ops, err := s.ops(cmd.Consumer)
	if err != nil {
		return res, fmt.Errorf("dlq-discard: %w", err)
	}
	req := transport.DiscardRequest{DLQSelection: cmd.selection(), Max: cmd.Max, DryRun: cmd.DryRun,
		Progress: func(done, total int64) { s.progress(cmd.Operation, done, total) }}
	if !s.cfg.Inbox.Own() {
		// Checked before anything is deleted: the events must be marked
		// handled where the consumer dedupes, or a replay would apply them.
		if err := s.cfg.Inbox.Check(ctx, s.db); err != nil {
			return res, fmt.Errorf("dlq-discard: %s (the consumer's inbox table, where the discarded events are marked handled): %w", inbox.EnvInboxTable, err)
		}
	}
	auditID := int64(0)
	if !cmd.DryRun {
		if auditID, err = s.auditStart(ctx, s.db, cmd); err != nil {
			return res, err
		}
		res.AuditID = auditID
	}
	d, opErr := ops.Discard(ctx, req)
	res.Affected = int64(len(d.Discarded))
	res.DLQ = &DLQListing{Consumer: cmd.Consumer, From: SourceDLQ, Total: -1, Complete: d.Complete, Messages: d.Discarded, Missing: d.Missing}
	if cmd.From != "" {
		res.DLQ.From = cmd.From
	}
	if res.DLQ.Messages == nil {
		res.DLQ.Messages = []transport.DLQMessage{}
	}
	exact := d.Complete
	res.Exact = &exact
	var released, marked int64
	if opErr == nil && !cmd.DryRun && len(d.Discarded) > 0 {
		marked, released, opErr = s.settleDiscarded(ctx, cmd, d.Discarded)
		if opErr != nil {
			opErr = fmt.Errorf("the messages are deleted, but they were not marked handled and their holds not released (run release-holds for their groups): %w", opErr)
		}
	}
	if opErr == nil && len(d.Missing) > 0 {
		opErr = fieldErr("messages", "not found in %s of %s: %s (on SNS/SQS a message behind its group's first one can be reached only once the ones before it are gone)",
			cmd.fromText(), cmd.Consumer, strings.Join(d.Missing, ", "))
	}
	if auditID != 0 {
		if err := s.auditFinish(ctx, auditID, cmd, res.Affected, opErr); err != nil && opErr == nil {
			opErr = err
		}
	}
	verb := "discarded"
	if cmd.DryRun {
		verb = "would discard"
	}
	res.Message = fmt.Sprintf("%s %d messages from %s of %s", verb, len(d.Discarded), cmd.fromText(), cmd.Consumer)
	if marked > 0 {
		res.Message += fmt.Sprintf("; %d events marked handled for %s (a replay does not apply them)", marked, cmd.Consumer)
	}
	if released > 0 {
		res.Message += fmt.Sprintf("; %d held rows released (their groups' remaining messages apply in order when redriven)", released)
	}
	if cmd.DryRun && !d.Complete {
		res.Message += " (at least: SQS shows a group's later messages only once the ones before it are gone)"
	}
	if opErr != nil {
		return res, fmt.Errorf("dlq-discard: %w", opErr)
	}
	return res, nil
}

// markDiscarded records the discarded events as handled in the consumer's
// inbox table: fifobox's inbox with outcome 'discarded', or the table of
// the consumer's own (Config.Inbox), which has no outcome column, with the
// claim row applying them would write.
func (s *Service) markDiscarded(ctx context.Context, tx pgx.Tx, consumer string, msgs []transport.DLQMessage, ids, types, aggs []string, seqs []int64) (int64, error) {
	t := s.cfg.Inbox
	if t.Own() {
		tag, err := tx.Exec(ctx, sqlInboxDiscarded, consumer, ids, types, aggs, seqs)
		if err != nil {
			return 0, err
		}
		return tag.RowsAffected(), nil
	}
	var marked int64
	for _, m := range msgs {
		if _, err := uuid.Parse(m.Key); err != nil {
			continue // not an envelope: nothing can apply it
		}
		e := envelope.Envelope{ID: m.Key, Type: m.EventType, AggregateType: m.AggregateType, AggregateID: m.Group, Sequence: m.Sequence}
		fresh, err := t.Claim(ctx, tx, consumer, e)
		if err != nil {
			return 0, fmt.Errorf("%w (%s names the consumer's inbox table)", err, inbox.EnvInboxTable)
		}
		if fresh {
			marked++
		}
	}
	return marked, nil
}

// settleDiscarded records the discarded messages' events in the
// consumer's inbox with outcome 'discarded' (messages that are not valid
// envelopes have no event id, and nothing can apply them anyway) and, for
// the consumer queue's DLQ, deletes their inbox_held rows and all rows of
// the groups discarded whole, in one transaction: the group's hold moves
// to its next message exactly when the discarded one counts as handled.
func (s *Service) settleDiscarded(ctx context.Context, cmd Command, msgs []transport.DLQMessage) (marked, released int64, err error) {
	groups, keys := []string{}, []string{}
	ids, types, aggs := []string{}, []string{}, []string{}
	seqs := []int64{}
	whole := []string{}
	sel := transport.DLQSelection{Groups: cmd.Groups, Aggregates: cmd.Aggregates}
	for _, m := range msgs {
		groups, keys = append(groups, m.Group), append(keys, m.Key)
		if !sel.All() && sel.Matches(m) {
			whole = append(whole, m.Group)
		}
		if _, perr := uuid.Parse(m.Key); perr == nil {
			ids, types, aggs, seqs = append(ids, m.Key), append(types, m.AggregateType), append(aggs, m.Group), append(seqs, m.Sequence)
		}
	}
	err = pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		if marked, err = s.markDiscarded(ctx, tx, cmd.Consumer, msgs, ids, types, aggs, seqs); err != nil {
			return fmt.Errorf("mark handled: %w", err)
		}
		if cmd.From == SourceSubscriptionDLQ {
			return nil // SNS never delivered them to the consumer: nothing holds a group
		}
		tag, err := tx.Exec(ctx, sqlReleaseHeldMessages, cmd.Consumer, groups, keys)
		if err != nil {
			return fmt.Errorf("release holds: %w", err)
		}
		released = tag.RowsAffected()
		tag, err = tx.Exec(ctx, sqlReleaseHeldGroups, cmd.Consumer, whole)
		if err != nil {
			return fmt.Errorf("release holds: %w", err)
		}
		released += tag.RowsAffected()
		return nil
	})
	if err != nil {
		return 0, 0, err
	}
	return marked, released, nil
}
