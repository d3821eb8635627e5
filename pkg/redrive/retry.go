package redrive

import (
	"context"
	"fmt"
	"regexp"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/outbox"
)

// ErrorsStatus says why events retry or died: the most frequent error
// classes of retrying and dead events (status).
type ErrorsStatus struct {
	Section
	Classes []ErrorClass `json:"classes"`
}

// ErrorClass is one kind of publish failure: errors that differ only in
// ids, request ids and large numbers are one class.
type ErrorClass struct {
	// Kind is "retrying" (aggregates backing off, counted by their head
	// event) or "dead" (dead events).
	Kind string `json:"kind"`
	// Class is the error with its ids replaced by placeholders.
	Class string `json:"class"`
	// Count is how many aggregates (retrying) or events (dead) have it.
	Count int64 `json:"count"`
	// Newest is the most recent event's error in full.
	Newest string `json:"newest"`
	newest int64
}

// maxClasses bounds the classes status shows; errorTexts how many distinct
// texts it reads to build them.
const (
	maxClasses = 5
	errorTexts = 500
)

var (
	uuidRE    = regexp.MustCompile(`[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}`)
	hexRE     = regexp.MustCompile(`\b[0-9a-fA-F]{8,}\b`)
	numberRE  = regexp.MustCompile(`\b\d{5,}\b`)
	requestRE = regexp.MustCompile(`(?i)(request ?id:?\s*)[^\s,;]+`)
)

// classOf is err's class: ids, request ids and numbers of five digits or
// more become placeholders, so one outage is one class however many events
// it failed.
func classOf(err string) string {
	c := requestRE.ReplaceAllString(err, "${1}<id>")
	c = uuidRE.ReplaceAllString(c, "<id>")
	c = hexRE.ReplaceAllStringFunc(c, func(s string) string {
		if !strings.ContainsAny(s, "0123456789") {
			return s // a word
		}
		return "<id>"
	})
	c = numberRE.ReplaceAllString(c, "<n>")
	c = strings.Join(strings.Fields(c), " ")
	if c == "" {
		c = "(no error recorded)"
	}
	return c
}

// errorClasses groups the outbox's retrying and dead errors into classes.
func (s *Service) errorClasses(ctx context.Context) ErrorsStatus {
	es := ErrorsStatus{Section: Section{State: StateOK}, Classes: []ErrorClass{}}
	if s.db == nil {
		es.Section = Section{State: dbState(s.cfg.DBError), Error: s.cfg.DBError.Error()}
		return es
	}
	texts, err := outbox.ErrorTexts(ctx, s.db, errorTexts)
	if err != nil {
		es.Section = Section{State: dbState(err), Error: err.Error()}
		return es
	}
	byClass := map[[2]string]*ErrorClass{}
	for _, t := range texts {
		k := [2]string{t.Kind, classOf(t.Text)}
		c, ok := byClass[k]
		if !ok {
			c = &ErrorClass{Kind: t.Kind, Class: k[1]}
			byClass[k] = c
		}
		c.Count += t.Count
		if t.NewestID > c.newest {
			c.newest, c.Newest = t.NewestID, t.Text
		}
	}
	for _, c := range byClass {
		es.Classes = append(es.Classes, *c)
	}
	sort.Slice(es.Classes, func(i, j int) bool {
		a, b := es.Classes[i], es.Classes[j]
		if a.Count != b.Count {
			return a.Count > b.Count
		}
		return a.newest > b.newest
	})
	if len(es.Classes) > maxClasses {
		es.Classes = es.Classes[:maxClasses]
	}
	return es
}

// retryNow makes the selected backing-off aggregates due now, audited in
// the transaction that changes them.
func (s *Service) retryNow(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	sel := outbox.RetrySelection{AggregateType: cmd.AggregateType, AggregateIDs: cmd.AggregateIDs, ErrorContains: cmd.Error}
	aggs, events, err := outbox.RetryNow(ctx, s.db, sel, true)
	if err != nil {
		return res, err
	}
	res.Affected, res.Aggregates = events, int(aggs)
	if aggs > int64(cmd.Max) {
		return res, fmt.Errorf("retry-now: %w", fieldErr("max", "%d aggregates selected, more than %d: narrow the selection or raise it", aggs, cmd.Max))
	}
	if cmd.DryRun {
		res.Message = fmt.Sprintf("would make %d backing-off aggregates (%d events) due now", aggs, events)
		return res, nil
	}
	err = pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		id, err := s.auditStart(ctx, tx, cmd)
		if err != nil {
			return err
		}
		res.AuditID = id
		if aggs, events, err = outbox.RetryNow(ctx, tx, sel, false); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, sqlAuditDone, id, aggs)
		return err
	})
	if err != nil {
		return res, fmt.Errorf("retry-now: %w", err)
	}
	res.Affected, res.Aggregates = events, int(aggs)
	res.Message = fmt.Sprintf("made %d backing-off aggregates (%d events) due now: the next dispatch publishes them", aggs, events)
	s.log.Info("redrive operation finished", "audit_id", res.AuditID, "operation", cmd.Operation, "actor", cmd.Actor, "status", "done", "affected", aggs)
	return res, nil
}

// repairHeads derives every head from the outbox (outbox.RebuildHeads), so
// stranded events become claimable, audited in the transaction that
// changes them. A dry run counts the stranded events.
func (s *Service) repairHeads(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	b, err := outbox.Stats(ctx, s.db)
	if err != nil {
		return res, fmt.Errorf("repair-heads: %w", err)
	}
	if cmd.DryRun {
		res.Affected = b.StrandedEvents
		res.Message = fmt.Sprintf("%d events are stranded (pending over %s, no claim reaches them); repair-heads would make them publishable", b.StrandedEvents, outbox.StrandedAfter)
		return res, nil
	}
	var heads int64
	err = pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		id, err := s.auditStart(ctx, tx, cmd)
		if err != nil {
			return err
		}
		res.AuditID = id
		if heads, err = outbox.RebuildHeads(ctx, tx); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, sqlAuditDone, id, heads)
		return err
	})
	if err != nil {
		return res, fmt.Errorf("repair-heads: %w", err)
	}
	res.Affected, res.Aggregates = heads, int(heads)
	res.Message = fmt.Sprintf("derived %d heads from the outbox (%d events were stranded): the next dispatch publishes them", heads, b.StrandedEvents)
	s.log.Info("redrive operation finished", "audit_id", res.AuditID, "operation", cmd.Operation, "actor", cmd.Actor, "status", "done", "affected", heads)
	return res, nil
}
