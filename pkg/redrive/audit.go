package redrive

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// AuditEntry is one redrive_audit row.
type AuditEntry struct {
	ID         int64           `json:"id"`
	Operation  string          `json:"operation"`
	Actor      string          `json:"actor"`
	RequestID  string          `json:"request_id,omitempty"`
	Params     json.RawMessage `json:"params"`
	DryRun     bool            `json:"dry_run"`
	Status     string          `json:"status"`
	Affected   int64           `json:"affected"`
	Error      string          `json:"error,omitempty"`
	StartedAt  time.Time       `json:"started_at"`
	FinishedAt *time.Time      `json:"finished_at,omitempty"`
}

type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// params is what the audit records of a command: the selection, never payloads.
func params(cmd Command) []byte {
	p := cmd
	// These have their own columns; empty, they are left out of the JSON.
	p.Actor, p.RequestID, p.Operation, p.DryRun = "", "", "", false
	b, _ := json.Marshal(p)
	return b
}

// auditStart inserts a 'started' row and returns its id.
func (s *Service) auditStart(ctx context.Context, db execer, cmd Command) (int64, error) {
	var id int64
	err := db.QueryRow(ctx, sqlAuditStart, cmd.Operation, cmd.Actor, cmd.RequestID, string(params(cmd)), cmd.DryRun).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("write audit row: %w", err)
	}
	s.log.Info("redrive operation started", "audit_id", id, "operation", cmd.Operation, "actor", cmd.Actor,
		"request_id", cmd.RequestID, "params", string(params(cmd)), "dry_run", cmd.DryRun)
	return id, nil
}

// auditFinish records the outcome; opErr nil means done.
func (s *Service) auditFinish(ctx context.Context, id int64, cmd Command, affected int64, opErr error) error {
	status, text := "done", ""
	if opErr != nil {
		status, text = "failed", opErr.Error()
		if len(text) > 2000 {
			text = text[:2000]
		}
	}
	// The outcome must be recorded even if the caller's context is ending.
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_, err := s.db.Exec(actx, sqlAuditFinish,
		id, status, affected, text)
	lvl := s.log.Info
	if opErr != nil {
		lvl = s.log.Error
	}
	lvl("redrive operation finished", "audit_id", id, "operation", cmd.Operation, "actor", cmd.Actor,
		"status", status, "affected", affected, "dry_run", cmd.DryRun, "error", text)
	if err != nil {
		return fmt.Errorf("update audit row %d: %w", id, err)
	}
	return nil
}

// ListAudit returns the most recent audit rows, newest first.
func ListAudit(ctx context.Context, db execerQuery, limit int) ([]AuditEntry, error) {
	rows, err := db.Query(ctx, sqlListAudit, limit)
	if err != nil {
		return nil, fmt.Errorf("list audit: %w", err)
	}
	defer rows.Close()
	var out []AuditEntry
	for rows.Next() {
		var a AuditEntry
		if err := rows.Scan(&a.ID, &a.Operation, &a.Actor, &a.RequestID, &a.Params, &a.DryRun, &a.Status, &a.Affected,
			&a.Error, &a.StartedAt, &a.FinishedAt); err != nil {
			return nil, fmt.Errorf("list audit: %w", err)
		}
		out = append(out, a)
	}
	return out, rows.Err()
}

type execerQuery interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// audit lists the most recent audit rows (default 20), newest first.
func (s *Service) audit(ctx context.Context, cmd Command) (Result, error) {
	limit := cmd.Limit
	if limit == 0 {
		limit = 20
	}
	rows, err := ListAudit(ctx, s.db, limit)
	if err != nil {
		return Result{Operation: cmd.Operation}, err
	}
	if rows == nil {
		rows = []AuditEntry{}
	}
	return Result{Operation: cmd.Operation, Affected: int64(len(rows)), Audit: rows}, nil
}
