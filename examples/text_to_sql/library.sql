-- A small lending library: the database the text-to-SQL example's questions are about.
-- The agent builds a SQLite file from this script at run time and opens it read-only.

CREATE TABLE authors (
    author_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    country TEXT NOT NULL,
    birth_year INTEGER
);

CREATE TABLE books (
    book_id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    author_id INTEGER NOT NULL REFERENCES authors (author_id),
    genre TEXT NOT NULL,
    published_year INTEGER NOT NULL,
    pages INTEGER NOT NULL
);

CREATE TABLE members (
    member_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    city TEXT NOT NULL,
    joined_year INTEGER NOT NULL
);

CREATE TABLE loans (
    loan_id INTEGER PRIMARY KEY,
    book_id INTEGER NOT NULL REFERENCES books (book_id),
    member_id INTEGER NOT NULL REFERENCES members (member_id),
    loan_date TEXT NOT NULL,
    returned INTEGER NOT NULL -- 1 once the book is back, 0 while it is out
);

INSERT INTO authors VALUES
    (1, 'Ines Varga', 'Hungary', 1961),
    (2, 'Tomas Lind', 'Sweden', 1978),
    (3, 'Amara Okafor', 'Nigeria', 1985),
    (4, 'Luis Ferreira', 'Portugal', 1949),
    (5, 'Mei Tanaka', 'Japan', 1972),
    (6, 'Clara Holm', 'Sweden', 1990),
    (7, 'Noor Haddad', 'Jordan', 1995);

INSERT INTO books VALUES
    (1, 'The Salt Road', 1, 'history', 1998, 412),
    (2, 'Quiet Harbors', 2, 'fiction', 2009, 288),
    (3, 'Paper Lanterns', 5, 'fiction', 2015, 320),
    (4, 'River of Names', 3, 'fiction', 2018, 264),
    (5, 'Counting Stars', 5, 'science', 2011, 198),
    (6, 'The Last Orchard', 4, 'fiction', 1983, 356),
    (7, 'Maps of the North', 2, 'history', 2016, 440),
    (8, 'Small Machines', 6, 'science', 2021, 176),
    (9, 'A Year of Rain', 1, 'fiction', 2004, 300),
    (10, 'Stone and Tide', 4, 'history', 1991, 502),
    (11, 'Bright Circuits', 6, 'science', 2023, 224),
    (12, 'The Glass Garden', 3, 'fiction', 2022, 310);

INSERT INTO members VALUES
    (1, 'Ada Moreno', 'Lisbon', 2017),
    (2, 'Ben Carter', 'Oslo', 2019),
    (3, 'Chen Wei', 'Lisbon', 2020),
    (4, 'Dana Kowalski', 'Krakow', 2018),
    (5, 'Eli Navon', 'Oslo', 2022),
    (6, 'Farah Aziz', 'Krakow', 2021);

INSERT INTO loans VALUES
    (1, 2, 1, '2024-01-05', 1),
    (2, 3, 1, '2024-02-11', 1),
    (3, 5, 2, '2024-02-20', 1),
    (4, 7, 3, '2024-03-02', 0),
    (5, 2, 4, '2024-03-15', 1),
    (6, 8, 5, '2024-03-28', 0),
    (7, 1, 2, '2024-04-09', 1),
    (8, 12, 6, '2024-04-18', 1),
    (9, 3, 3, '2024-05-01', 1),
    (10, 4, 4, '2024-05-12', 0),
    (11, 2, 6, '2024-05-30', 1),
    (12, 11, 1, '2024-06-07', 0),
    (13, 9, 5, '2024-06-21', 1),
    (14, 6, 2, '2024-07-04', 0),
    (15, 10, 6, '2024-07-19', 1);
