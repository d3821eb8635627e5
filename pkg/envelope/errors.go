package envelope

import (
	"errors"
	"fmt"
)

// Sentinel kinds of validation failure. A *ValidationError unwraps to one of
// them, so callers can branch with errors.Is without string matching.
var (
	// ErrMissing: a required field is empty.
	ErrMissing = errors.New("required field is missing")
	// ErrInvalid: a field is present but malformed.
	ErrInvalid = errors.New("field is invalid")
	// ErrTooLarge: the encoded message exceeds the publish size limit.
	ErrTooLarge = errors.New("message is too large")
)

// ValidationError reports one invalid field of an envelope.
type ValidationError struct {
	// Field is the JSON name of the offending field, e.g. "aggregate_id".
	Field string
	// Kind is ErrMissing, ErrInvalid or ErrTooLarge.
	Kind error
	// Reason is a human-readable explanation (never contains payload data).
	Reason string
}

func (e *ValidationError) Error() string {
	if e.Reason == "" {
		return fmt.Sprintf("envelope: %s: %v", e.Field, e.Kind)
	}
	return fmt.Sprintf("envelope: %s: %v: %s", e.Field, e.Kind, e.Reason)
}

// Unwrap returns the sentinel kind so errors.Is(err, ErrMissing) works.
func (e *ValidationError) Unwrap() error { return e.Kind }

func missing(field string) error {
	return &ValidationError{Field: field, Kind: ErrMissing}
}

func invalid(field, format string, args ...any) error {
	return &ValidationError{Field: field, Kind: ErrInvalid, Reason: fmt.Sprintf(format, args...)}
}

// IsValidation reports whether err is (or wraps) a *ValidationError.
func IsValidation(err error) bool {
	var ve *ValidationError
	return errors.As(err, &ve)
}

// PermanentError marks a failure to handle an event that no retry can fix,
// on either side of the broker: a publish the broker rejects for good
// (invalid parameter, message too large; the dispatcher marks the event dead
// at once), or a side effect that can never succeed (the consumer sends the
// message to its dead-letter queue at once instead of retrying). Any other
// error is retried.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err as a PermanentError (nil stays nil).
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err is, or wraps, a PermanentError.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}
