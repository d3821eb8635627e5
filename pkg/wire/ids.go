package wire

import (
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/oklog/ulid/v2"
)

// IDFormat is how a profile writes event ids. fifobox stores every event id
// as 128 bits (a UUID column); a ULID is the same 128 bits in Crockford
// base32, so an id converts both ways without loss.
type IDFormat string

// The id formats.
const (
	// UUID: 8-4-4-4-12 lower-case hex (the default).
	UUID IDFormat = "uuid"
	// ULID: 26 characters of Crockford base32 (corebilling's event ids).
	ULID IDFormat = "ulid"
)

func (f IDFormat) valid() bool { return f == UUID || f == ULID }

// Format writes the stored event id (a UUID string) in f.
func (f IDFormat) Format(stored string) string {
	if f != ULID {
		return stored
	}
	u, err := uuid.Parse(stored)
	if err != nil {
		return stored
	}
	return ulid.ULID(u).String()
}

// Stored converts an id written in f to the UUID fifobox stores. A ULID is
// accepted in either case; a UUID in any form uuid.Parse reads.
func (f IDFormat) Stored(id string) (string, error) {
	if f == ULID {
		u, err := ulid.ParseStrict(strings.ToUpper(id))
		if err != nil {
			return "", fmt.Errorf("%q is not a ULID: %v", id, err)
		}
		return uuid.UUID(u).String(), nil
	}
	u, err := uuid.Parse(id)
	if err != nil {
		return "", fmt.Errorf("%q is not a UUID: %v", id, err)
	}
	return u.String(), nil
}
