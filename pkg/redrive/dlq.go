package redrive

import (
	"context"
	"fmt"

	"github.com/fifobox/fifobox/pkg/transport"
)

// dlqRedrive moves up to Max messages from the consumer's DLQ (or, on SNS,
// its subscription's DLQ) back to its queue through the transport's
// Operations, which keeps each aggregate's order; the audit row brackets
// the move. A crash midway may deliver a message twice: the consumer's
// inbox drops the copy.
func (s *Service) dlqRedrive(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	ops, err := s.ops(cmd.Consumer)
	if err != nil {
		return res, fmt.Errorf("dlq-redrive: %w", err)
	}
	req := transport.RedriveRequest{Consumer: cmd.Consumer, From: transport.DLQ(cmd.Source), Max: cmd.Max, DryRun: cmd.DryRun,
		Progress: func(moved, total int64) { s.progress(cmd.Operation, moved, total) }}
	from := "the DLQ"
	if req.From == transport.SubscriptionDLQ {
		from = "the subscription DLQ"
	}
	if cmd.DryRun {
		r, err := ops.Redrive(ctx, req)
		if err != nil {
			return res, fmt.Errorf("dlq-redrive: %w", err)
		}
		res.Affected = int64(r.Moved)
		res.Message = fmt.Sprintf("would move %d of about %d messages from %s of %s", r.Moved, r.Waiting, from, cmd.Consumer)
		if r.InFlight >= 0 {
			res.Message = fmt.Sprintf("would move %d of about %d messages (%d in flight) from %s of %s", r.Moved, r.Waiting, r.InFlight, from, cmd.Consumer)
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
		return res, fmt.Errorf("dlq-redrive: after %d messages: %w", r.Moved, opErr)
	}
	res.Message = fmt.Sprintf("moved %d messages from %s of %s back to its queue", r.Moved, from, cmd.Consumer)
	if r.Left > 0 {
		res.Message += fmt.Sprintf("; %d dead-lettered again during the redrive stay for the next one", r.Left)
	}
	return res, nil
}
